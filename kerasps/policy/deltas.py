"""The on-disk format of published versions (`kerasps.callbacks.PublishDeltas`): pure Python.

A publish directory holds one folder per version, `v00000001`, `v00000002` ..., each
made whole in a temporary folder beside them (`.tmp-v00000002-<random>`) and then
made visible by one `os.rename`, so a reader never sees part of one. A version folder
holds its payload files and `manifest.json`:

```json
{"format": "kerasps-deltas", "format_version": 1,
 "version": 7, "applies_to": 6, "kind": "delta",
 "files": {"dense.npz": "<sha256>", "table_0.ids.npy": "<sha256>", ...},
 "tables": [...], "dense": {...}}
```

`kind` is `"full"` (every row of every table; `applies_to` is `null`) or `"delta"`
(the rows that changed since version `applies_to`, which is `version - 1`). `files`
names every payload file with the sha256 of its bytes. What `tables` and `dense` hold
is the publisher's and the consumer's business (`kerasps.keras.publish`,
`kerasps.keras.serving`); this module only names, writes, lists and checks versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid

FORMAT = "kerasps-deltas"
FORMAT_VERSION = 1
FULL = "full"
DELTA = "delta"
MANIFEST = "manifest.json"
TEMPORARY_PREFIX = ".tmp-"
_NAME = re.compile(r"^v(\d{8,})$")


class DeltaError(ValueError):
    """A version that cannot be applied: a gap in the chain, a bad checksum, a manifest
    that is not kerasps' (a `ValueError`)."""


def version_name(version: int) -> str:
    return f"v{version:08d}"


def versions(directory) -> list[int]:
    """The visible versions of `directory`, in order (temporary folders are not)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_temporaries(directory) -> list[str]:
    """Removes what a publisher killed while writing left (temporary folders)."""
    removed = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(TEMPORARY_PREFIX):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(name)
    return removed


class VersionWriter:
    """Writes one version: payload files into a temporary folder, then `commit()` adds
    the manifest (with each file's sha256) and renames the folder into place.

    ```python
    with VersionWriter(directory, 7, applies_to=6, kind="delta") as writer:
        with open(writer.path("dense.npz"), "wb") as f: ...
        writer.commit(tables=[...], dense={...})
    ```
    Leaving the `with` block without `commit()` (an exception) removes the folder.
    """

    def __init__(self, directory, version: int, applies_to: int | None, kind: str):
        if kind not in (FULL, DELTA):
            raise ValueError(f"Invalid value for argument `kind`: expected {FULL!r} or "
                             f"{DELTA!r}. Received: kind={kind!r}")
        self.directory = os.fspath(directory)
        self.version, self.applies_to, self.kind = int(version), applies_to, kind
        self.final = os.path.join(self.directory, version_name(self.version))
        self.temporary = os.path.join(
            self.directory, f"{TEMPORARY_PREFIX}{version_name(self.version)}-{uuid.uuid4().hex}")
        self.files: list[str] = []
        self.committed = False

    def __enter__(self):
        os.makedirs(self.temporary)
        return self

    def __exit__(self, *exc_info):
        if not self.committed:
            shutil.rmtree(self.temporary, ignore_errors=True)
        return False

    def path(self, name: str) -> str:
        """Where to write the payload file `name` (recorded for the manifest)."""
        if "/" in name or name == MANIFEST or name in self.files:
            raise ValueError(f"Invalid payload file name. Received: name={name!r}")
        self.files.append(name)
        return os.path.join(self.temporary, name)

    def commit(self, **content) -> str:
        """Writes the manifest and makes the version visible; returns its folder."""
        if os.path.exists(self.final):
            raise DeltaError(
                f"Version {self.version} already exists in {self.directory!r}: two "
                "publishers write to one directory. Received: version={self.version}")
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "version": self.version,
            "applies_to": self.applies_to, "kind": self.kind,
            "files": {name: sha256_of(os.path.join(self.temporary, name))
                      for name in self.files},
            **content,
        }
        path = os.path.join(self.temporary, MANIFEST)
        with open(path, "w") as file:
            json.dump(manifest, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.rename(self.temporary, self.final)  # the one step that makes it visible
        self.committed = True
        return self.final


def read_manifest(folder) -> dict:
    """The manifest of the version in `folder`, checked to be kerasps'."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as file:
            manifest = json.load(file)
    except FileNotFoundError:
        raise DeltaError(f"Invalid version folder {folder!r}: it has no {MANIFEST}. "
                         f"Received: {sorted(os.listdir(folder))}") from None
    except json.JSONDecodeError as error:
        raise DeltaError(f"Invalid manifest {path!r}: it is not JSON ({error}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DeltaError(f"Invalid manifest {path!r}: expected format {FORMAT!r}. "
                         f"Received: format={getattr(manifest, 'get', dict().get)('format')!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise DeltaError(
            f"Invalid manifest {path!r}: written by a newer kerasps (format_version "
            f"{manifest['format_version']}, this one reads up to {FORMAT_VERSION}).")
    return manifest


def read_checked(folder, manifest: dict, name: str) -> bytes:
    """The bytes of payload file `name`, checked against the manifest's sha256."""
    expected = manifest["files"].get(name)
    if expected is None:
        raise DeltaError(f"Invalid version {manifest['version']}: its manifest does not "
                         f"name the file {name!r}. Received: files={sorted(manifest['files'])}")
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise DeltaError(f"Invalid version {manifest['version']} in {folder!r}: the file "
                         f"{name!r} its manifest names is missing.") from None
    received = hashlib.sha256(data).hexdigest()
    if received != expected:
        raise DeltaError(
            f"Bad checksum of {path!r} (version {manifest['version']}): expected sha256 "
            f"{expected}. Received: sha256 {received}. The file was changed or damaged "
            "after it was published; the version is not applied.")
    return data


def check_next(current: int | None, manifest: dict) -> bool:
    """Whether the version of `manifest` is to be applied by a consumer at `current`:
    `False` for a version already applied (a repeat is done), `True` for the next one;
    a delta that does not apply to `current` (a gap) raises a `DeltaError`."""
    version, kind = manifest["version"], manifest["kind"]
    if current is not None and version <= current:
        return False
    if kind == FULL:
        return True
    if current is None:
        raise DeltaError(
            f"Version {version} is a delta of version {manifest['applies_to']}, and nothing "
            "was loaded yet: expected a full version first. Received: kind='delta'")
    if manifest["applies_to"] != current:
        raise DeltaError(
            f"Gap in the published versions: the consumer is at version {current}, so "
            f"expected version {current + 1} (a delta of {current}) or a full version. "
            f"Received: version {version}, a delta of version {manifest['applies_to']}.")
    return True
