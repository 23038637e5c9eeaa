"""check.sh's summary line for one ftflow run: from its manifest.json when the run completed, else from
its log's per-epoch line (training ended, a later stage did not), else its exit alone.
    python3 summary.py NAME RUN_DIR EXIT_CODE WALL_SECONDS"""

import glob
import json
import re
import sys
from pathlib import Path

name, run, rc, wall = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
end = f"exit {rc}{' (killed at its limit)' if rc == 124 else ''}, {wall} s wall"
try:
    manifest = json.loads(Path(run, "manifest.json").read_text())
    epoch, seconds = manifest["metrics"]["training"]["history"][-1], manifest["seconds"]
    first = seconds.get("start to first training step")
    print(
        f"RESULT ftflow {name}: {epoch['samples_per_s']:.1f} samples/s, peak {epoch['peak_memory_mb']:.0f} MiB, "
        f"train {seconds['train']:.1f} s, first step at {first if first is None else round(first, 1)} s, "
        f"test accuracy {manifest['metrics']['test']['accuracy']:.4f}, {end}"
    )
    phases = seconds.get("phases", {})  # where the seconds went, from the process's start to the report
    print(f"RESULT ftflow {name} phases: " + ", ".join(f"{phase} {s:.1f}" for phase, s in phases.items()))
except (OSError, KeyError, IndexError, ValueError):
    found = None
    for log in sorted(glob.glob(f"{run}/logs/*.log")):
        for line in open(log, errors="replace"):
            found = re.search(r"\(([\d.]+) samples/s, peak (\d+) MiB per worker\)", line) or found
    trained = f"{found[1]} samples/s, peak {found[2]} MiB (its log), no manifest, " if found else "no epoch ended, "
    print(f"RESULT ftflow {name}: {trained}{end}")
