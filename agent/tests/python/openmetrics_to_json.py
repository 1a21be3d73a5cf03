"""Parses an OpenMetrics text exposition (stdin) with prometheus_client's own strict parser, the
reference implementation of the format, and prints the families as JSON for the Rust tests:
[{"name", "type", "samples": [{"name", "labels", "value"}]}]. A malformed exposition fails here."""
import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families

families = []
for family in text_string_to_metric_families(sys.stdin.read()):
    families.append({
        "name": family.name,
        "type": family.type,
        "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in family.samples],
    })
json.dump(families, sys.stdout)
