"""Nereus runtime layer (see DESIGN.md)."""
