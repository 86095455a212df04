"""Draft model definitions shared by training, export and evaluation."""
