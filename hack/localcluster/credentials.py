"""How clients reach the cluster: the CA and the certificates of the API server and the
kubelets, the admin token and S3 keys (.cluster/secrets.json), the kubeconfigs and
.cluster/env."""
from __future__ import annotations

import base64
import json
import os
import secrets
from pathlib import Path

from . import config as C
from . import realnodes as R
from .proc import sh


def ensure_pki(cfg: C.ClusterConfig) -> None:
    """A CA, an API server certificate valid for every address clients use (host, pods, the
    in-cluster service names) and the service-account signing key."""
    pki = cfg.pki
    if (pki / "apiserver.crt").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"), "-subj", "/CN=sftjob-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", "subjectKeyIdentifier=hash")
    sans = [f"IP:{cfg.host_ip}", "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"]
    (pki / "apiserver.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        f"subjectAltName={','.join(sans)}\n")
    sh("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "apiserver.key"),
        "-out", str(pki / "apiserver.csr"), "-subj", "/CN=kube-apiserver")
    sh("openssl", "x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(pki / "ca.crt"),
        "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
        "-extfile", str(pki / "apiserver.ext"), "-out", str(pki / "apiserver.crt"))
    sh("openssl", "genrsa", "-out", str(pki / "sa.key"), "2048")
    # each kubelet's serving certificate (logs, exec, port-forward), for its node address
    for i, node in enumerate(cfg.nodes):
        _signed(pki, f"kubelet-{i}", f"/CN={node}", "serverAuth", f"subjectAltName=IP:{R.node_ip(cfg, i)},DNS:{node}\n")
    # the API server's client certificate towards kubelets (authorised through RBAC, as
    # kubeadm's apiserver-kubelet-client)
    _signed(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth", "")


def _signed(pki: Path, name: str, subject: str, usage: str, extra: str) -> None:
    (pki / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n{extra}")
    sh("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / f"{name}.key"),
        "-out", str(pki / f"{name}.csr"), "-subj", subject)
    sh("openssl", "x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
        "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
        "-extfile", str(pki / f"{name}.ext"), "-out", str(pki / f"{name}.crt"))


def ensure_secrets(cfg: C.ClusterConfig) -> dict:
    if cfg.secrets_file.exists():
        return json.loads(cfg.secrets_file.read_text())
    data = {
        "admin_token": secrets.token_hex(24),
        "s3_access_key": "sftjob-" + secrets.token_hex(4),
        "s3_secret_key": secrets.token_hex(16),
    }
    cfg.secrets_file.write_text(json.dumps(data))
    cfg.secrets_file.chmod(0o600)
    # Static token users: "token,user,uid,groups". The admin is in system:masters; every other
    # identity (ServiceAccounts) authenticates with real signed tokens from the TokenRequest API.
    (cfg.pki / "tokens.csv").write_text(f'{data["admin_token"]},sftjob-admin,sftjob-admin,"system:masters"\n')
    return data


def write_client_files(cfg: C.ClusterConfig, sec: dict) -> None:
    ca = base64.b64encode((cfg.pki / "ca.crt").read_bytes()).decode()
    cfg.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: sftjob-local
  cluster:
    server: {cfg.apiserver_url}
    certificate-authority-data: {ca}
users:
- name: sftjob-admin
  user:
    token: {sec["admin_token"]}
contexts:
- name: sftjob-local
  context:
    cluster: sftjob-local
    user: sftjob-admin
    namespace: default
current-context: sftjob-local
""")
    cfg.kubeconfig.chmod(0o600)
    # what the node components (kubelets, kube-proxy, CoreDNS) authenticate with: the admin
    # token, in a file of its own so that a narrower identity can replace it without touching
    # the user's kubeconfig
    node_kc = cfg.state_dir / "node-kubeconfig"
    node_kc.write_text(cfg.kubeconfig.read_text())
    node_kc.chmod(0o600)
    lines = {k: v for k, v in env(cfg).items() if k != "PATH"}
    text = "".join(f"export {k}={v}\n" for k, v in lines.items())
    text += f'export PATH={C.bin_dir("k8s")}:{C.bin_dir("helm")}:$PATH\n'
    cfg.env_file.write_text(text)


def env(cfg: C.ClusterConfig | None = None) -> dict[str, str]:
    """The variables of .cluster/env as a dict (PATH with the cached kubectl and helm first)."""
    cfg = cfg or C.load()
    sec = json.loads(cfg.secrets_file.read_text())
    return {
        "KUBECONFIG": str(cfg.kubeconfig),
        "AWS_ENDPOINT_URL": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": sec["s3_access_key"],
        "AWS_SECRET_ACCESS_KEY": sec["s3_secret_key"],
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PATH": f'{C.bin_dir("k8s")}:{C.bin_dir("helm")}:{os.environ.get("PATH", "")}',
    }
