"""Real speculative decoding (chain and EAGLE-2 trees) measuring acceptance length."""
