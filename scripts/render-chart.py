"""Renders a Helm chart with Helm's own library (helm-python-sdk binds Helm's Go SDK) and prints
{"manifests": {template: text}, "lint": [errors]} as JSON, for the Rust chart test to parse.

usage: render-chart.py CHART_DIR RELEASE NAMESPACE VALUES_JSON
"""
import json
import sys

import helm_python as helm


def main() -> None:
    chart_dir, release, namespace, values = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    lint = helm.lint(chart_dir, values, namespace=namespace, strict=True)
    with helm.Chart.load(chart_dir) as chart:
        manifests = chart.render(values, name=release, namespace=namespace)
    # Severity 3 is an error; warnings (2) fail too, as `helm lint --strict` does.
    problems = [str(e) for e in lint.get("errors", [])]
    problems += [f'{m["path"]}: {m["error"]}' for m in lint.get("messages", []) if m.get("severity", 0) >= 2]
    json.dump({"manifests": manifests, "lint": problems, "helm": helm.helm_sdk_version()}, sys.stdout)


if __name__ == "__main__":
    main()
