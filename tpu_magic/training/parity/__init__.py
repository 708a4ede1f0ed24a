"""The first-step parity check: a cell's first distributed step against the same step on one device."""
