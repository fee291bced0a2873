"""Pure tests: one process, no ranks and no device; the planning code and the wiring's own logic on hand-made
inputs, in milliseconds."""
