"""Nereus passes layer (see DESIGN.md)."""
