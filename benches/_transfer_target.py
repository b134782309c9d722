"""The far end of the transfer benchmarks: ``kvbridge.tools._bench_target`` as a script."""

from kvbridge.tools._bench_target import main
from kvbridge.tools._bench_wire import RAW_HEADER, TOTAL, read_ready, shuffled_offsets

__all__ = ["RAW_HEADER", "TOTAL", "main", "read_ready", "shuffled_offsets"]

if __name__ == "__main__":
    main()
