"""`make bench-operator`: the operator at scale on kwok nodes (run), its instruments
(harness) and statistics (stats)."""
