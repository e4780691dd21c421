"""Pluggable inference backends behind one small protocol (see backends/base.py)."""
