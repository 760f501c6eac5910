"""Layers that carry a state from one chunk to the next (linear attention, state-space layers, short
convolutions), run one chunk at a time from the state the previous chunk left."""
