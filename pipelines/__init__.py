"""Jobs built on the hsstore library: extract, train, export, evaluate, and the CLI that drives them.

Pipelines import ``hsstore``; ``hsstore`` never imports pipelines.
"""
