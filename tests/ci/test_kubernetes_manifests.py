"""deploy/kubernetes/ holds to the docs: its AFD configs parse as config.md says, its Service publishes the
rendezvous port of FFN rank 0, its probes hit the endpoints of operations.md, and its replica counts add up
to num_attention_ranks / num_ffn_ranks (docs/operations.md#pools-across-hosts).

Each check is a function that raises ``ManifestError`` naming the manifest and the fix; the repository's
manifests pass all of them, and a broken copy of each is refused (the second half of this file).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from vllm_afd.config import AFDConfig  # noqa: E402
from vllm_afd.config.fields import FIELD_NAMES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
OPERATIONS = ROOT / "docs" / "operations.md"
ROLES = ("attention", "ffn")


class ManifestError(AssertionError):
    """A manifest disagrees with the docs."""


# ---- reading ----------------------------------------------------------------------------------------------

def load_documents(directory: Path = MANIFESTS) -> list[dict[str, Any]]:
    """Every YAML document of every manifest, in file order."""
    documents = []
    for path in sorted(directory.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is None:
                continue
            if not {"apiVersion", "kind", "metadata"} <= set(document):
                raise ManifestError(f"{path.name}: a document without apiVersion/kind/metadata: {document!r}")
            documents.append(document)
    return documents


def of_kind(documents: list[dict], kind: str) -> list[dict]:
    return [d for d in documents if d["kind"] == kind]


def role_of(statefulset: dict) -> str:
    role = statefulset["spec"]["template"]["metadata"]["labels"].get("role")
    if role not in ROLES:
        raise ManifestError(f"StatefulSet {statefulset['metadata']['name']}: pod label role={role!r}; expected "
                            f"one of {ROLES}")
    return role


def pools(documents: list[dict]) -> dict[str, dict]:
    """role -> its one StatefulSet."""
    found: dict[str, dict] = {}
    for statefulset in of_kind(documents, "StatefulSet"):
        role = role_of(statefulset)
        if role in found:
            raise ManifestError(f"two StatefulSets for role {role}; expected one per role pool")
        found[role] = statefulset
    if set(found) != set(ROLES):
        raise ManifestError(f"StatefulSets for roles {sorted(found)}; expected one for each of {ROLES}")
    return found


def container(statefulset: dict) -> dict:
    (vllm,) = statefulset["spec"]["template"]["spec"]["containers"]
    return vllm


def env_value(statefulset: dict, name: str) -> str:
    for entry in container(statefulset).get("env", ()):
        if entry["name"] == name:
            return entry["value"]
    raise ManifestError(f"StatefulSet {statefulset['metadata']['name']}: no env {name}")


def afd_mapping(statefulset: dict) -> dict:
    """The `afd` mapping of the pool's --additional-config (the AFD_CONFIG variable the command passes)."""
    script = command_text(statefulset)
    if '--additional-config "$AFD_CONFIG"' not in script:
        raise ManifestError(f"StatefulSet {statefulset['metadata']['name']}: the command does not pass "
                            '--additional-config "$AFD_CONFIG"')
    additional = json.loads(env_value(statefulset, "AFD_CONFIG"))
    if set(additional) != {"afd"}:
        raise ManifestError(f"AFD_CONFIG holds {sorted(additional)}; expected only the key 'afd'")
    return additional["afd"]


def command_text(statefulset: dict) -> str:
    vllm = container(statefulset)
    return " ".join([*vllm.get("command", ()), *vllm.get("args", ())])


def flag(statefulset: dict, name: str, default: str | None = None) -> str | None:
    """The value of a `vllm serve` flag in the pool's command; every occurrence must agree."""
    values = set(re.findall(rf"{re.escape(name)}[ =]+(\S+)", command_text(statefulset).replace("\\\n", " ")))
    if len(values) > 1:
        raise ManifestError(f"StatefulSet {statefulset['metadata']['name']}: {name} given as {sorted(values)}")
    return values.pop() if values else default


def int_flag(statefulset: dict, name: str, default: int) -> int:
    value = flag(statefulset, name, str(default))
    if not value.isdigit():
        raise ManifestError(f"StatefulSet {statefulset['metadata']['name']}: {name} {value!r}; expected a literal "
                            "integer (the rank arithmetic is checked against it)")
    return int(value)


# ---- the checks -------------------------------------------------------------------------------------------

def check_afd_configs(documents: list[dict], stand_in_secret: Path) -> dict[str, AFDConfig]:
    """Every `afd` key is one of AFDConfig's fields (canonical names), the value is legal (config.md's
    validation), the role matches the pool, and both roles agree on everything but `role`.

    The parse reads `secret_file`, which exists only in the pod: ``stand_in_secret`` (a readable file) stands
    in for it in the returned configs (check_secret holds the manifests' own path to the mounts).
    """
    parsed = {}
    for role, statefulset in pools(documents).items():
        afd = afd_mapping(statefulset)
        unknown = sorted(set(afd) - set(FIELD_NAMES))
        if unknown:
            raise ManifestError(f"{role} pool: AFD keys {unknown} are not config fields; expected some of "
                                f"{FIELD_NAMES} (docs/config.md)")
        in_pod = afd.get("secret_file", "")
        try:
            config = AFDConfig.from_mapping({**afd, "secret_file": str(stand_in_secret) if in_pod else ""},
                                            expected_role=role)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{role} pool: its AFD config is refused: {exc}") from exc
        if not isinstance(in_pod, str) or not in_pod.startswith("/"):
            raise ManifestError(f"{role} pool: secret_file {in_pod!r}; expected an absolute path in the pod")
        parsed[role] = config
    ffn, attention = (parsed[r].to_mapping() for r in ("ffn", "attention"))
    differing = sorted(k for k in FIELD_NAMES if k != "role" and ffn[k] != attention[k])
    if differing:
        raise ManifestError(f"the two pools' AFD configs differ in {differing}; expected the same config but role")
    return parsed


def check_rendezvous_service(documents: list[dict], configs: dict[str, AFDConfig]) -> None:
    """A headless Service publishing FFN rank 0 (pod 0 of the FFN StatefulSet) under the config's `host`, on
    the config's `port`, before the pod is ready."""
    ffn = pools(documents)["ffn"]
    name = ffn["spec"]["serviceName"]
    services = [s for s in of_kind(documents, "Service") if s["metadata"]["name"] == name]
    if len(services) != 1:
        raise ManifestError(f"FFN StatefulSet serviceName {name!r}: {len(services)} Services of that name; expected 1")
    spec = services[0]["spec"]
    if spec.get("clusterIP") != "None" or spec.get("publishNotReadyAddresses") is not True:
        raise ManifestError(f"Service {name}: expected clusterIP None (headless: pod 0 gets its own name) and "
                            "publishNotReadyAddresses true (FFN rank 0 listens on its name before it is ready)")
    labels = ffn["spec"]["template"]["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in spec["selector"].items()):
        raise ManifestError(f"Service {name}: selector {spec['selector']} does not select the FFN pods {labels}")
    config = configs["ffn"]
    rank0 = f"{ffn['metadata']['name']}-0.{name}"
    if config.host.split(".svc")[0] not in (rank0, f"{rank0}.{ffn['metadata'].get('namespace', '')}".rstrip(".")):
        raise ManifestError(f"AFD host {config.host!r}; expected FFN rank 0's stable name {rank0!r} "
                            "(pod 0 of the FFN StatefulSet under its headless Service)")
    published = {(p.get("targetPort", p["port"]), p["port"]) for p in spec["ports"]}
    if (config.port, config.port) not in published:
        raise ManifestError(f"Service {name}: ports {sorted(published)} do not publish the AFD rendezvous port "
                            f"{config.port} (config `port`) as itself")
    opened = {p["containerPort"] for p in container(ffn).get("ports", ())}
    if config.port not in opened:
        raise ManifestError(f"FFN container ports {sorted(opened)} lack the AFD rendezvous port {config.port}")


def probe_endpoints(probe: dict, http_port: str) -> set[str]:
    """The endpoints one probe asks: "/health", or "/metrics afd_peer_up" (the readiness grep)."""
    if "httpGet" in probe:
        if str(probe["httpGet"]["port"]) != http_port:
            raise ManifestError(f"probe {probe}: port {probe['httpGet']['port']}; expected the server's --port "
                                f"{http_port}")
        return {probe["httpGet"]["path"]}
    text = " ".join(probe["exec"]["command"])
    found = set()
    for port, path in re.findall(r"https?://(?:127\.0\.0\.1|localhost):(\d+)(/\w+)", text):
        if port != http_port:
            raise ManifestError(f"probe {text!r}: port {port}; expected the server's --port {http_port}")
        found.add(f"{path} afd_peer_up" if path == "/metrics" and "afd_peer_up" in text else path)
    if not found:
        raise ManifestError(f"probe {text!r} asks no HTTP endpoint")
    return found


def operations_probes() -> dict[str, set[str]]:
    """Per probe kind, the endpoints the Probes table of operations.md names."""
    text = OPERATIONS.read_text()
    section = text.split("## Probes", 1)[1].split("\n## ", 1)[0]
    table = {}
    for kind in ("start-up", "liveness", "readiness"):
        row = next(line for line in section.splitlines() if line.startswith(f"| {kind} |"))
        table[kind] = {"/health"} if "/health" in row else set()
        if "/metrics" in row and "afd_peer_up" in row:
            table[kind].add("/metrics afd_peer_up")
    return table


PROBE_KINDS = {"startupProbe": "start-up", "livenessProbe": "liveness", "readinessProbe": "readiness"}


def check_probes(documents: list[dict]) -> None:
    """Every pool has the three probes, each asking an endpoint operations.md names for that probe."""
    named = operations_probes()
    for role, statefulset in pools(documents).items():
        http_port = flag(statefulset, "--port")
        if http_port is None:
            raise ManifestError(f"{role} pool: its command sets no --port")
        for field, kind in PROBE_KINDS.items():
            probe = container(statefulset).get(field)
            if probe is None:
                raise ManifestError(f"{role} pool: no {field} (docs/operations.md#probes names one)")
            asked = probe_endpoints(probe, http_port)
            if not asked <= named[kind]:
                raise ManifestError(f"{role} pool: its {kind} probe asks {sorted(asked)}; docs/operations.md#probes "
                                    f"names {sorted(named[kind])}")


def check_rank_arithmetic(documents: list[dict], configs: dict[str, AFDConfig]) -> None:
    """replicas x DP ranks per pod x TP = num_<role>_ranks; DP size = replicas x DP ranks per pod."""
    for role, statefulset in pools(documents).items():
        replicas = statefulset["spec"]["replicas"]
        dp = int_flag(statefulset, "--data-parallel-size", 1)
        dp_local = int_flag(statefulset, "--data-parallel-size-local", dp)
        tp = int_flag(statefulset, "--tensor-parallel-size", 1)
        expected = configs[role].num_role_ranks
        if replicas * dp_local * tp != expected or replicas * dp_local != dp:
            raise ManifestError(
                f"{role} pool: replicas {replicas} x DP ranks per pod {dp_local} x TP {tp} with --data-parallel-size "
                f"{dp}; expected replicas x DP-per-pod = DP size and x TP = num_{role}_ranks ({expected})")
        if replicas > 1:
            script = command_text(statefulset)
            if statefulset["spec"].get("podManagementPolicy") != "Parallel":
                raise ManifestError(f"{role} pool: {replicas} replicas need podManagementPolicy Parallel (rank 0 is "
                                    "ready only once the headless ranks joined it)")
            if "--headless" not in script or '--data-parallel-start-rank "$rank"' not in script:
                raise ManifestError(f"{role} pool: pods past the first must run --headless with "
                                    "--data-parallel-start-rank set to the pod's ordinal")


def check_secret(documents: list[dict]) -> None:
    """`secret_file` is a key of a Secret of these manifests, mounted read-only where the config names it."""
    secrets = {s["metadata"]["name"]: s for s in of_kind(documents, "Secret")}
    for role, statefulset in pools(documents).items():
        in_pod = afd_mapping(statefulset).get("secret_file", "")
        if not in_pod:
            raise ManifestError(f"{role} pool: no secret_file; docs/security.md wants the shared secret")
        path = Path(in_pod)
        mounts = {m["name"]: m for m in container(statefulset).get("volumeMounts", ())}
        volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"].get("volumes", ())}
        for name, mount in mounts.items():
            secret_name = volumes.get(name, {}).get("secret", {}).get("secretName")
            if Path(mount["mountPath"]) == path.parent and secret_name in secrets:
                keys = {*secrets[secret_name].get("stringData", {}), *secrets[secret_name].get("data", {})}
                if path.name in keys and mount.get("readOnly") is True:
                    break
        else:
            raise ManifestError(f"{role} pool: secret_file {path} is not a key of a Secret here mounted read-only at "
                                f"{path.parent}")


def check_all(documents: list[dict], stand_in_secret: Path) -> None:
    configs = check_afd_configs(documents, stand_in_secret)
    check_rendezvous_service(documents, configs)
    check_probes(documents)
    check_rank_arithmetic(documents, configs)
    check_secret(documents)


# ---- the repository's manifests -----------------------------------------------------------------------------

@pytest.fixture
def stand_in_secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("stand-in\n")
    return path


def test_the_manifests_hold_to_the_docs(stand_in_secret):
    check_all(load_documents(), stand_in_secret)


def test_the_ffn_pods_find_rank_0_by_its_stable_name(stand_in_secret):
    documents = load_documents()
    ffn = pools(documents)["ffn"]
    host = check_afd_configs(documents, stand_in_secret)["ffn"].host
    rank0_branch, headless_branch = container(ffn)["args"][0].split("fi\n")
    # Pod 0 binds vLLM's DP sockets on its own IP; the headless pods dial the name the AFD store lives at.
    assert '--data-parallel-address "$POD_IP"' in rank0_branch and "--headless" not in rank0_branch
    assert shlex.split(headless_branch)[-2:] == ["--data-parallel-address", host], headless_branch
    assert int_flag(ffn, "--data-parallel-rpc-port", 0) in {p["containerPort"] for p in container(ffn)["ports"]}


# ---- a broken copy is refused -------------------------------------------------------------------------------

def _set_afd(documents, role, **fields):
    statefulset = pools(documents)[role]
    for entry in container(statefulset)["env"]:
        if entry["name"] == "AFD_CONFIG":
            config = json.loads(entry["value"])
            config["afd"].update(fields)
            entry["value"] = json.dumps(config)


def _break_unknown_key(documents):
    _set_afd(documents, "ffn", afd_rank=0)
    _set_afd(documents, "attention", afd_rank=0)


def _break_illegal_value(documents):
    _set_afd(documents, "ffn", port=70000)
    _set_afd(documents, "attention", port=70000)


def _break_disagreeing_roles(documents):
    _set_afd(documents, "attention", num_stages=2)


def _break_service_port(documents):
    service = next(s for s in of_kind(documents, "Service") if s["spec"].get("clusterIP") == "None")
    for port in service["spec"]["ports"]:
        if port["name"] == "afd-store":
            port["port"] = port["targetPort"] = 6391


def _break_ready_addresses(documents):
    service = next(s for s in of_kind(documents, "Service") if s["spec"].get("clusterIP") == "None")
    del service["spec"]["publishNotReadyAddresses"]


def _break_probe_endpoint(documents):
    container(pools(documents)["attention"])["readinessProbe"]["httpGet"]["path"] = "/v1/models"


def _break_probe_port(documents):
    container(pools(documents)["attention"])["startupProbe"]["httpGet"]["port"] = 8001


def _break_replicas(documents):
    pools(documents)["ffn"]["spec"]["replicas"] = 3


def _break_ordered_start(documents):
    del pools(documents)["ffn"]["spec"]["podManagementPolicy"]


def _break_secret_mount(documents):
    for mount in container(pools(documents)["ffn"])["volumeMounts"]:
        if mount["name"] == "afd-secret":
            mount["mountPath"] = "/etc/afd"


@pytest.mark.parametrize("breakage", [
    _break_unknown_key, _break_illegal_value, _break_disagreeing_roles, _break_service_port, _break_ready_addresses,
    _break_probe_endpoint, _break_probe_port, _break_replicas, _break_ordered_start, _break_secret_mount,
], ids=lambda f: f.__name__.removeprefix("_break_"))
def test_a_broken_manifest_is_refused(breakage, stand_in_secret):
    documents = copy.deepcopy(load_documents())
    breakage(documents)
    with pytest.raises(ManifestError):
        check_all(documents, stand_in_secret)
