"""Trainer side of Dartboard: pure PyTorch model I/O, losses and the training loop (no Django)."""
