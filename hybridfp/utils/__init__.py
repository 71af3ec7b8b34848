"""Bottom-layer helpers shared by every part of hybridfp (imports only torch and numpy)."""
