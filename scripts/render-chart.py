"""Renders a Helm chart with Helm's own library (helm-python-sdk binds Helm's Go SDK) and prints
{"manifests": {template: text}, "lint": [errors]} as JSON, for the Rust chart test to parse.

usage: render-chart.py CHART_DIR RELEASE NAMESPACE VALUES_JSON [CLUSTER_APIS_JSON]

Without CLUSTER_APIS_JSON the chart is rendered offline, as `helm template` does: Helm's default
capabilities, so `.Capabilities.APIVersions.Has` sees only built-in APIs.

With CLUSTER_APIS_JSON (a JSON list of "group/version/Kind" strings, e.g.
["monitoring.coreos.com/v1/PodMonitor"]) the chart is rendered as `helm install --dry-run=server`
does, against a mock API server in this process that serves discovery only: the built-in kinds the
chart uses plus the listed ones. Helm reads its capabilities from that discovery, exactly as on a
cluster where those CRDs are installed. Nothing is created: the mock refuses every write.
"""
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import helm_python as helm

# (group, version, kind, plural, namespaced) of the built-in kinds the chart renders. "" is core.
BUILT_IN = [
    ("", "v1", "Service", "services", True),
    ("", "v1", "ServiceAccount", "serviceaccounts", True),
    ("", "v1", "ConfigMap", "configmaps", True),
    ("", "v1", "Secret", "secrets", True),
    ("apps", "v1", "Deployment", "deployments", True),
    ("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets", True),
    ("rbac.authorization.k8s.io", "v1", "Role", "roles", True),
    ("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings", True),
    ("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles", False),
    ("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings", False),
    ("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions", False),
]


def discovery_server(extra: list[str]) -> ThreadingHTTPServer:
    """A mock API server answering discovery (and an empty OpenAPI document, so that Helm's
    client-side validation skips the kinds it has no schema for); 404 for every object read,
    500 for every write."""
    kinds = list(BUILT_IN)
    for entry in extra:
        group, version, kind = entry.split("/")
        kinds.append((group, version, kind, kind.lower() + "s", True))
    by_group: dict[str, dict[str, list]] = {}
    for group, version, kind, plural, namespaced in kinds:
        by_group.setdefault(group, {}).setdefault(version, []).append((kind, plural, namespaced))

    def resource_list(group_version: str, resources: list) -> dict:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": [
                {"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                 "verbs": ["get", "list", "create", "patch", "delete"]}
                for kind, plural, namespaced in resources
            ],
        }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def reply(self, code: int, body: bytes = b"", content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?")[0].rstrip("/")
            parts = path.split("/")
            body = None
            if path == "/version":
                body = {"major": "1", "minor": "31", "gitVersion": "v1.31.0"}
            elif path == "/api":
                body = {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
            elif path == "/api/v1":
                body = resource_list("v1", by_group[""]["v1"])
            elif path == "/apis":
                groups = []
                for group, versions in by_group.items():
                    if group == "":
                        continue
                    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
                    groups.append({"name": group, "versions": listed, "preferredVersion": listed[0]})
                body = {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
            elif len(parts) == 4 and parts[1] == "apis" and parts[3] in by_group.get(parts[2], {}):
                body = resource_list(f"{parts[2]}/{parts[3]}", by_group[parts[2]][parts[3]])
            elif path == "/openapi/v2":
                # An empty protobuf document: no schemas, so validation skips every kind.
                self.reply(200, b"", "application/octet-stream")
                return
            if body is None:
                self.reply(404, json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound"}).encode())
            else:
                self.reply(200, json.dumps(body).encode())

        def refuse(self) -> None:
            self.reply(500, json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500, "message": "the mock API server takes no writes"}).encode())

        do_POST = do_PUT = do_PATCH = do_DELETE = refuse

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def render_against_mock_cluster(chart_dir: str, release: str, namespace: str, values: dict, apis: list[str]) -> dict[str, str]:
    server = discovery_server(apis)
    kubeconfig = json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "mock", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "contexts": [{"name": "mock", "context": {"cluster": "mock", "user": "mock"}}],
        "current-context": "mock",
        "users": [{"name": "mock", "user": {"token": "mock"}}],
    })
    try:
        with helm.Config(kubeconfig_content=kubeconfig, namespace=namespace, storage_driver="memory") as config:
            release_info = config.install(chart_dir, release, values, namespace=namespace, dry_run="server")
    finally:
        server.shutdown()
    return {"release": release_info["manifest"]}


def main() -> None:
    chart_dir, release, namespace, values = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    lint = helm.lint(chart_dir, values, namespace=namespace, strict=True)
    if len(sys.argv) > 5:
        manifests = render_against_mock_cluster(chart_dir, release, namespace, values, json.loads(sys.argv[5]))
    else:
        with helm.Chart.load(chart_dir) as chart:
            manifests = chart.render(values, name=release, namespace=namespace)
    # Severity 3 is an error; warnings (2) fail too, as `helm lint --strict` does.
    problems = [str(e) for e in lint.get("errors", [])]
    problems += [f'{m["path"]}: {m["error"]}' for m in lint.get("messages", []) if m.get("severity", 0) >= 2]
    json.dump({"manifests": manifests, "lint": problems, "helm": helm.helm_sdk_version()}, sys.stdout)


if __name__ == "__main__":
    main()
