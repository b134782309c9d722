"""Write three pages through a kvbridge HiCache backend in a process of its own, as
another SGLang engine would: ``python write_pages.py SPEC_JSON``.

SPEC: server (address), extra (more of the backend's extra config), model_name (the
storage config's, i.e. the served name), seed (of the pool's bytes). No model settings are
published in this process, as none are where SGLang's scheduler did not publish them.
"""

from __future__ import annotations

import json
import sys

from host_pools import MHAPool
from test_sglang_backend import backend, names


def main() -> None:
    spec = json.loads(sys.argv[1])
    pool = MHAPool()
    pool.fill(seed=spec["seed"])
    extra = {"server": spec["server"], "interface_v1": 1, **spec.get("extra", {})}
    made = backend(pool, extra, model_name=spec["model_name"])
    written = made.batch_set_v1(names(3), pool.slots(0, 1, 2))
    made.close()
    print("RESULT " + json.dumps({"written": written}), flush=True)


if __name__ == "__main__":
    main()
