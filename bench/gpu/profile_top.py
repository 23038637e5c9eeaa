"""Where a training worker's time goes, from check.sh's py-spy speedscope file: each thread's active
samples, then the training thread's functions by the share of its samples they are on the stack of
(inclusive).
    python3 bench/gpu/profile_top.py profile/worker.speedscope.json [HOW_MANY]"""

import json
import sys
from collections import Counter
from pathlib import Path

data = json.loads(Path(sys.argv[1]).read_text())
how_many = int(sys.argv[2]) if len(sys.argv) > 2 else 30
frames = data["shared"]["frames"]
profiles = {profile["name"]: profile for profile in data["profiles"]}
print("active samples per thread (py-spy skips idle ones): a busy thread beside training holds the GIL too")
for name, profile in sorted(profiles.items(), key=lambda item: -sum(item[1]["weights"])):
    print(f"  {sum(profile['weights']):8.0f}  {name}")
training = next((profile for name, profile in profiles.items() if "TrainingThread" in name), None)
if training is None:
    sys.exit("no TrainingThread in the profile")
total = sum(training["weights"])
inclusive: Counter[int] = Counter()
for stack, weight in zip(training["samples"], training["weights"], strict=True):
    for index in set(stack):
        inclusive[index] += weight
print(f"the training thread's functions, by the share of its {total:.0f} samples they are on the stack of")
for index, weight in inclusive.most_common(how_many):
    frame = frames[index]
    where = "/".join(Path(frame.get("file") or "?").parts[-2:])
    print(f"  {weight / total:6.1%}  {frame['name']} ({where}:{frame.get('line')})")
# Self: the innermost Python frame of each sample, where a wait on the device (.item(), .tolist(), a
# synchronize) or a host loop shows itself.
innermost: Counter[int] = Counter()
for stack, weight in zip(training["samples"], training["weights"], strict=True):
    if stack:
        innermost[stack[-1]] += weight
print(f"the training thread's innermost frames, by share of its {total:.0f} samples")
for index, weight in innermost.most_common(how_many):
    frame = frames[index]
    where = "/".join(Path(frame.get("file") or "?").parts[-2:])
    print(f"  {weight / total:6.1%}  {frame['name']} ({where}:{frame.get('line')})")
