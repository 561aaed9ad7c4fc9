"""Nereus backend layer (see DESIGN.md)."""
