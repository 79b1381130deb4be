"""Summarize junit xml of the stock / plugin runs into results/*.txt and print the comparison."""
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RES = Path(__file__).parent / os.environ.get("RES", "results")


def load(xml_path):
    """nodeid -> (outcome, first message line, test-file location, raise location)"""
    out = {}
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        parts = cls.split(".")
        # classname like tests.tests_pytorch.checkpointing.test_model_checkpoint[.Class]
        i = max(k for k, p in enumerate(parts) if p.startswith("test_")) if any(p.startswith("test_") for p in parts) else len(parts) - 1
        mod = "/".join(parts[: i + 1]) + ".py"
        nodeid = "::".join([mod] + parts[i + 1 :] + [name])
        outcome, msg, loc_test, loc_raise = "passed", "", "", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                if tc.find("failure") is not None and tag == "error":
                    outcome = "failed+error"
                text = el.text or ""
                msg = (el.get("message") or "").strip().splitlines()[0:1]
                msg = msg[0] if msg else ""
                locs = re.findall(r"^(\S+\.py):(\d+): (\S.*)$", text, re.M)
                test_locs = [loc for loc in locs if "tests_pytorch" in loc[0] or "tests_fabric" in loc[0]]
                if test_locs:
                    loc_test = f"{test_locs[-1][0]}:{test_locs[-1][1]}"
                if locs:
                    loc_raise = f"{locs[-1][0]}:{locs[-1][1]}: {locs[-1][2]}"
                break
        if nodeid in out and out[nodeid][0] != "passed":
            continue  # keep the first non-pass record
        out[nodeid] = (outcome, msg, loc_test, loc_raise)
    return out


def write(name, lines):
    (RES / name).write_text("\n".join(lines) + ("\n" if lines else ""))


def main():
    runs = sys.argv[1:]  # label=path.xml ...
    data = {}
    for r in runs:
        label, path = r.split("=", 1)
        if not Path(path).exists():
            print(f"{label}: {path} missing (run did not finish?)")
            continue
        d = load(path)
        data[label] = d
        for oc in ("passed", "failed", "error", "failed+error", "skipped"):
            write(f"{label}_{oc}.txt", sorted(k for k, v in d.items() if v[0] == oc))
        write(f"{label}_all.txt", [f"{k}\t{v[0]}\t{v[1]}\t{v[2]}\t{v[3]}" for k, v in sorted(d.items())])
        counts = {}
        for v in d.values():
            counts[v[0]] = counts.get(v[0], 0) + 1
        print(f"{label}: {len(d)} tests: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    stock = data.get("stock")
    if stock is None:
        return
    stock_pass = {k for k, v in stock.items() if v[0] == "passed"}
    for label, d in data.items():
        if label == "stock":
            continue
        kept = sorted(k for k in stock_pass if d.get(k, ("missing",))[0] == "passed")
        lost = sorted(k for k in stock_pass if d.get(k, ("missing",))[0] != "passed")
        gained = sorted(k for k, v in d.items() if v[0] == "passed" and k not in stock_pass)
        print(f"\n== {label}: stock passed {len(stock_pass)}; with {label} {len(kept)} of those pass; lost {len(lost)}; "
              f"newly passing {len(gained)}")
        lines = []
        for k in lost:
            v = d.get(k, ("missing", "", "", ""))
            lines.append(f"{k}\t{v[0]}\t{v[1]}\t{v[2]}\t{v[3]}")
        write(f"lost_{label}.txt", lines)
        write(f"gained_{label}.txt", gained)
        for line in lines:
            print("  LOST " + line.replace("\t", " | "))
        for g in gained:
            print("  GAINED " + g)


if __name__ == "__main__":
    main()
