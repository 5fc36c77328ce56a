"""Kiln stage."""
