"""What the tensor-list scripts in tests/data share (dump_real_shapes.py, qwen3_omni/dump_shapes.py):
the verdict their checks end with."""

from __future__ import annotations


def verdict(failures: list[str]) -> int:
    """Print whether every check passed and, if not, what failed; the exit status (1 when any failed)."""
    print("\nRESULT:", "all checks passed" if not failures else "FAILED")
    for f in failures:
        print("  -", f)
    return 1 if failures else 0
