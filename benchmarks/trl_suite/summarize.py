"""Summarise a pytest junit XML: counts, then every failure/error/skip with a one-line reason.

usage: summarize.py RESULTS_XML [agentrl|trl]
"""

import sys
import xml.etree.ElementTree as ET

# Run, but not counted as applicable offline: its asserted losses (1.8226, 0.1260) are constants computed
# from the Hub model trl-internal-testing/dummy-GPT2-correct-vocab's weights (and TRL's random value-head
# init); real TRL 0.11.4 fails it too on the local stand-ins (`run.sh trl`).
NOT_APPLICABLE_OFFLINE = {
    "test_loss_trainer": "hard-coded losses from the Hub model's weights (TRL 0.11.4 itself fails it offline)",
}
# Failures that are agentrl's documented, deliberate differences from TRL 0.11 (README table).
DOCUMENTED = {
    "test_batch_size_check": "README row 1: gradient_accumulation_steps too large is fitted with a warning",
}

target = sys.argv[2] if len(sys.argv) > 2 else "agentrl"
rows = {"passed": [], "failed": [], "error": [], "skipped": []}
for c in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name, kind, reason = c.get("name"), "passed", ""
    for child in c:
        if child.tag in ("failure", "error", "skipped"):
            kind = {"failure": "failed"}.get(child.tag, child.tag)
            reason = " ".join((child.get("message") or child.text or "").split())[:200]
            break
    rows[kind].append((name, reason))

total = sum(len(v) for v in rows.values())
applicable = [r for k in ("passed", "failed", "error") for r in rows[k] if r[0] not in NOT_APPLICABLE_OFFLINE]
passed = [r for r in rows["passed"] if r[0] not in NOT_APPLICABLE_OFFLINE]
print(f"== TRL v0.11.4 tests/test_ppo_trainer.py against {target}: {total} collected; "
      + ", ".join(f"{k} {len(v)}" for k, v in rows.items()))
print(f"== applicable: {len(applicable)} (collected - skipped - {len(NOT_APPLICABLE_OFFLINE)} not applicable offline); "
      f"passing {len(passed)} of {len(applicable)}")
for kind in ("failed", "error"):
    for name, reason in rows[kind]:
        tag = ("[not applicable offline] " + NOT_APPLICABLE_OFFLINE[name] if name in NOT_APPLICABLE_OFFLINE
               else "[documented difference] " + DOCUMENTED[name] if name in DOCUMENTED and target == "agentrl"
               else "[UNEXPECTED]")
        print(f"   {kind.upper():7s} {name}: {reason}\n           {tag}")
for name, reason in rows["skipped"]:
    print(f"   SKIPPED {name}: {reason}")
