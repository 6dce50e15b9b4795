"""A tiny stand-in for the Hugging Face Hub, for tests only: its local cache layout (write_cached_repo,
for offline runs; SnapshotDownload, for huggingface_hub.snapshot_download in-process) and its HTTP API
(FakeHub: 127.0.0.1 only, bounded, in a thread).

It implements just what huggingface_hub's own client calls for
  create_repo      POST /api/repos/create
  create_commit    POST /api/validate-yaml (README.md), POST /api/models/R/preupload/REV,
                   POST /R.git/info/lfs/objects/batch, PUT + POST verify on the LFS href it hands out
                   (plain "basic" LFS; Xet is never offered), POST /api/models/R/commit/REV (NDJSON)
  list_repo_files  GET  /api/models/R/tree/REV
  hf_hub_download  HEAD/GET /R/resolve/REV/PATH (with Range; `cut_next_download` simulates a dropped
                   connection so the client's resume-with-Range path runs)
  repo_info        GET  /api/models/R[/revision/REV]
with the X-Error-Code headers the client maps to RepositoryNotFoundError, GatedRepoError, ...
Uploaded LFS bodies are checked against their sha256 before they are stored. The server answers at
most `max_requests` requests, refuses bodies over `max_body` bytes, drops idle connections after
`timeout_s` and shuts itself down after `lifetime_s` seconds even if a test forgets to stop it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

WRITE_TOKEN = "hf_fake_write_token"
REPO = r"(?P<repo>[^/]+/[^/]+)"


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """What the Hub reports as the file's id: sha256 for LFS files, the git blob sha1 otherwise."""
        if self.lfs:
            return hashlib.sha256(self.data).hexdigest()
        return git_blob_sha1(self.data)


@dataclass
class Repo:
    private: bool = False
    gated: bool = False
    files: dict[str, StoredFile] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.commits[-1]


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def looks_binary(sample: bytes) -> bool:
    """The Hub stores binary files in LFS; a NUL byte in the first 512 bytes is enough for our files."""
    return b"\0" in sample[:512]


class FakeHub:
    """`with FakeHub() as hub:` serves on hub.url until the block ends (or lifetime_s passes)."""

    def __init__(self, token: str = WRITE_TOKEN, max_requests: int = 500, max_body: int = 64 << 20,
                 timeout_s: float = 10.0, lifetime_s: float = 120.0):
        self.token = token
        self.max_requests, self.max_body, self.timeout_s = max_requests, max_body, timeout_s
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []          # (method, path) of every request, in order
        self.range_starts: list[int] = []             # first byte asked for by each ranged GET
        self.cut_next_download: int | None = None     # drop the connection after this many body bytes, once
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.deadline = threading.Timer(lifetime_s, self.stop)
        self.deadline.daemon = True
        self.stopped = False

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        self.deadline.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
        self.deadline.cancel()
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo_id: str, files: dict[str, bytes], private=False, gated=False) -> str:
        """Create a repo holding `files` in one commit; returns the commit hash."""
        repo = self.repos.setdefault(repo_id, Repo(private=private, gated=gated))
        for path, data in files.items():
            repo.files[path] = StoredFile(data, looks_binary(data))
        return self.new_commit(repo_id, repo)

    def new_commit(self, repo_id: str, repo: Repo) -> str:
        state = repo_id + "".join(f"{p}:{f.oid}" for p, f in sorted(repo.files.items()))
        commit = hashlib.sha1(f"{len(repo.commits)}:{state}".encode()).hexdigest()
        repo.commits.append(commit)
        return commit


def closed_port_url() -> str:
    """A 127.0.0.1 URL nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def hub_env(home, endpoint: str | None = None, offline: bool = False, token: str | None = None) -> dict:
    """Environment for a subprocess using huggingface_hub against `endpoint` (default: a closed local
    port, so nothing can leave the machine) with its cache under `home`. Inherited HF_* settings
    (a developer's token, endpoint or offline flag) are dropped so they cannot leak into the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint or closed_port_url(), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return env


def write_cached_repo(cache_dir, repo_id: str, files: dict[str, bytes], commit: str,
                      refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay out `files` exactly as huggingface_hub caches a download of `repo_id` at `commit`:
    blobs/<etag> (sha256 for LFS files, git blob sha1 otherwise), snapshots/<commit>/<path> as a
    relative symlink to its blob, and refs/<branch> holding the commit. Returns the snapshot folder."""
    repo_folder = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_folder / "snapshots" / commit
    for path, data in files.items():
        blob = repo_folder / "blobs" / StoredFile(data, looks_binary(data)).oid
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():            # a later download into the same snapshot
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo_folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_folder / "refs" / ref).write_text(commit)
    return snapshot


class SnapshotDownload:
    """Stands in for huggingface_hub.snapshot_download: serves a local folder as a repo at one commit,
    records which files were asked for, and lays them out in `cache` as the real client does
    (write_cached_repo: shards are relative links into ../../blobs/). Returns the snapshot folder."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, remote: Path, cache: Path):
        self.remote, self.cache, self.calls = Path(remote), Path(cache), []

    def __call__(self, repo_id, revision=None, token=None, allow_patterns=None, **kwargs):
        self.calls.append({"repo_id": repo_id, "revision": revision, "token": token, "patterns": list(allow_patterns)})
        files = {p.name: p.read_bytes() for p in self.remote.iterdir() if p.name in allow_patterns}
        return str(write_cached_repo(self.cache, repo_id, files, self.COMMIT))


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def make_handler(hub: FakeHub):
    class Handler(FakeHubHandler):
        pass

    Handler.hub = hub
    Handler.timeout = hub.timeout_s
    return Handler


class FakeHubHandler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True   # headers and body go out as separate writes; don't wait 40 ms for ACKs

    ROUTES = [
        ("POST", re.compile(r"/api/repos/create"), "create_repo"),
        ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
        ("POST", re.compile(rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)"), "preupload"),
        ("POST", re.compile(rf"/{REPO}\.git/info/lfs/objects/batch"), "lfs_batch"),
        ("PUT", re.compile(r"/_lfs/(?P<oid>[0-9a-f]{64})"), "lfs_put"),
        ("POST", re.compile(r"/_lfs/(?P<oid>[0-9a-f]{64})/verify"), "lfs_verify"),
        ("POST", re.compile(rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)"), "commit"),
        ("GET", re.compile(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/.*)?"), "tree"),
        ("GET", re.compile(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?"), "repo_info"),
        ("GET", re.compile(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "resolve"),
        ("HEAD", re.compile(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "resolve"),
    ]

    def log_message(self, format, *args):  # keep test output clean
        pass

    def do_GET(self):
        self.dispatch("GET")

    def do_HEAD(self):
        self.dispatch("HEAD")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    # ------------------------------------------------------------------------------ plumbing

    def dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        with self.hub.lock:
            self.hub.log.append((method, path))
            over_budget = len(self.hub.log) > self.hub.max_requests
        try:
            if over_budget:
                raise HttpError(503, "request budget of the fake hub exhausted")
            body = self.read_body()
            for route_method, pattern, name in self.ROUTES:
                match = pattern.fullmatch(path)
                if route_method == method and match:
                    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    with self.hub.lock:
                        status, headers, payload = getattr(self, name)(body, **params)
                    break
            else:
                raise HttpError(404, f"no route for {method} {path}")
        except (KeyError, TypeError, ValueError) as e:
            headers, status, payload = {}, 400, {"error": f"malformed request ({type(e).__name__}: {e})"}
        except HttpError as e:
            headers = {"X-Error-Code": e.code} if e.code else {}
            headers["X-Error-Message"] = e.message
            status, payload = e.status, {"error": e.message}
        self.respond(status, headers, payload, head=method == "HEAD")

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self.read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.hub.max_body:
            raise HttpError(413, "body too large for the fake hub")
        return self.rfile.read(length)

    def read_chunked(self) -> bytes:
        parts, total = [], 0
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            total += size
            if total > self.hub.max_body:
                raise HttpError(413, "body too large for the fake hub")
            parts.append(self.rfile.read(size))
            self.rfile.readline()
            if size == 0:
                return b"".join(parts)

    def respond(self, status: int, headers: dict, payload, head: bool = False) -> None:
        if isinstance(payload, (bytes, bytearray)):
            data = bytes(payload)
            headers.setdefault("Content-Type", "application/octet-stream")
        else:
            data = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if head:
            return
        cut_at = getattr(self, "cut_at", None)
        if cut_at is None:
            self.wfile.write(data)
            return
        # A network failure mid-download: the promised Content-Length is never reached.
        self.wfile.write(data[:cut_at])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def json_body(self, body: bytes):
        try:
            return json.loads(body or b"null")
        except ValueError:
            raise HttpError(400, "body is not JSON") from None

    def authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.hub.token}"

    def require_write(self) -> None:
        if not self.authorized():
            raise HttpError(401, "Invalid credentials in Authorization header")

    def readable_repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self.authorized()):
            raise HttpError(404 if repo is None else 401, "Repository not found", "RepoNotFound")
        return repo

    def commit_of(self, repo: Repo, rev: str) -> str:
        if rev == "main":
            return repo.head
        if rev in repo.commits:
            return rev
        raise HttpError(404, "Invalid rev id", "RevisionNotFound")

    # ------------------------------------------------------------------------------ write API

    def create_repo(self, body):
        self.require_write()
        request = self.json_body(body)
        repo_id = f"{request['organization']}/{request['name']}"
        if repo_id in self.hub.repos:   # the Hub answers 409 with the url; exist_ok=True clients go on
            return 409, {}, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"}
        private = request.get("visibility") == "private" or bool(request.get("private"))
        repo = self.hub.repos[repo_id] = Repo(private=private)
        self.hub.new_commit(repo_id, repo)  # the Hub starts every repo with an initial commit
        return 200, {}, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id}

    def validate_yaml(self, body):
        content = self.json_body(body)["content"]
        errors = []
        if content.startswith("---\n"):
            front = content[4:].split("\n---\n", 1)[0]
            try:
                meta = yaml.safe_load(front)
            except yaml.YAMLError as e:
                meta, errors = None, [{"message": f"YAML does not parse: {e}"}]
            if not errors and not isinstance(meta, dict):
                errors = [{"message": "metadata must be a mapping"}]
        if errors:
            return 400, {}, {"errors": errors}
        return 200, {}, {"errors": [], "warnings": []}

    def preupload(self, body, repo, rev):
        self.require_write()
        stored = self.readable_repo(repo)
        files = []
        for item in self.json_body(body)["files"]:
            sample = base64.b64decode(item["sample"])
            existing = stored.files.get(item["path"])
            files.append({"path": item["path"], "uploadMode": "lfs" if looks_binary(sample) else "regular",
                          "shouldIgnore": False, "oid": existing.oid if existing else None})
        return 200, {}, {"files": files, "commitOid": stored.head}

    def lfs_batch(self, body, repo):
        self.require_write()
        self.readable_repo(repo)
        request = self.json_body(body)
        if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
            raise HttpError(400, "this fake hub only does basic LFS uploads")
        objects = []
        for obj in request["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.lfs_objects:
                href = f"{self.hub.url}/_lfs/{obj['oid']}"
                entry["actions"] = {"upload": {"href": href}, "verify": {"href": href + "/verify"}}
            objects.append(entry)
        return 200, {}, {"transfer": "basic", "objects": objects}

    def lfs_put(self, body, oid):
        if hashlib.sha256(body).hexdigest() != oid:
            raise HttpError(400, "uploaded bytes do not match their sha256")
        self.hub.lfs_objects[oid] = body
        return 200, {}, {}

    def lfs_verify(self, body, oid):
        request = self.json_body(body)
        data = self.hub.lfs_objects.get(oid)
        if data is None or len(data) != request.get("size"):
            raise HttpError(404, "object not uploaded")
        return 200, {}, {}

    def commit(self, body, repo, rev):
        self.require_write()
        stored = self.readable_repo(repo)
        if rev != "main":
            raise HttpError(400, "this fake hub only commits to main")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            raise HttpError(400, "commit payload must start with a header carrying a summary")
        changes = {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                changes[value["path"]] = StoredFile(base64.b64decode(value["content"]), False)
            elif line["key"] == "lfsFile":
                data = self.hub.lfs_objects.get(value["oid"])
                if data is None:
                    raise HttpError(422, f"LFS object {value['oid']} was never uploaded")
                changes[value["path"]] = StoredFile(data, True)
            else:
                raise HttpError(400, f"unsupported commit operation {line['key']}")
        stored.files.update(changes)
        commit = self.hub.new_commit(repo, stored)
        return 200, {}, {"success": True, "commitOid": commit, "commitUrl": f"{self.hub.url}/{repo}/commit/{commit}"}

    # ------------------------------------------------------------------------------ read API

    def tree(self, body, repo, rev):
        stored = self.readable_repo(repo)
        self.commit_of(stored, rev)
        entries = []
        for path, f in sorted(stored.files.items()):
            entry = {"type": "file", "path": path, "size": len(f.data), "oid": git_blob_sha1(f.data)}
            if f.lfs:
                entry["lfs"] = {"oid": f.oid, "size": len(f.data), "pointerSize": 130}
            entries.append(entry)
        return 200, {}, entries

    def repo_info(self, body, repo, rev="main"):
        stored = self.readable_repo(repo)
        return 200, {}, {"id": repo, "sha": self.commit_of(stored, rev), "private": stored.private,
                         "gated": stored.gated, "siblings": [{"rfilename": p} for p in sorted(stored.files)]}

    def resolve(self, body, repo, rev, path):
        stored = self.readable_repo(repo)
        commit = self.commit_of(stored, rev)
        if stored.gated and not self.authorized():
            raise HttpError(403, f"Access to model {repo} is restricted.", "GatedRepo")
        f = stored.files.get(path)
        if f is None:
            raise HttpError(404, "Entry not found", "EntryNotFound")
        headers = {"X-Repo-Commit": commit, "ETag": f'"{f.oid}"'}
        start = self.range_start(len(f.data))
        if self.command == "GET" and not start and self.hub.cut_next_download is not None:
            self.cut_at, self.hub.cut_next_download = self.hub.cut_next_download, None
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(f.data) - 1}/{len(f.data)}"
            return 206, headers, f.data[start:]
        return 200, headers, f.data

    def range_start(self, size: int) -> int:
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        start = int(match.group(1)) if match else 0
        if match:
            self.hub.range_starts.append(start)
        if start >= size and size:
            raise HttpError(416, "range not satisfiable")
        return start
