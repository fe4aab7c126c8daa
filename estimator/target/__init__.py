"""Models of the runtime targets fxmem estimates for (allocators, devices)."""
