"""Training drafts from the store: EAGLE-3/EAGLE-4 TTT objective, candidate heads, the loop."""
