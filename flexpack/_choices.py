"""The names of the packing strategies and overflow policies, without importing torch (the CLI's
argument parser reads them; ``flexpack.packing`` re-exports them)."""

STRATEGIES = ("bfd", "ffd", "greedy", "wrap")
OVERFLOWS = ("error", "split", "truncate", "drop")
