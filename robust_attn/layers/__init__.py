"""Attention layers of the families in the zoo (one module per family)."""
