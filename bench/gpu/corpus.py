"""A corpus to label: ROWS rows of SOURCE.jsonl's texts, repeated, in FILES JSONL files (id, text).
python3 corpus.py SOURCE.jsonl OUT_DIR ROWS FILES"""

import json
import os
import sys

src, out, rows, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
texts = [json.loads(line)["text"] for line in open(src)]
os.makedirs(out, exist_ok=True)
per = rows // files
for f in range(files):
    with open(f"{out}/part-{f:03d}.jsonl", "w") as fh:
        for i in range(per):
            r = f * per + i
            fh.write(json.dumps({"id": r, "text": texts[r % len(texts)]}) + "\n")
