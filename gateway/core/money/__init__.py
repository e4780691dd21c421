"""Money in the pipeline: the prices of a call (reserved at its worst case, settled at its cost)
and where budget alerts go (docs/pricing.md)."""
