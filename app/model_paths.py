"""Where the service may read model and draft directories: `builtin:NAME` (the tiny zoo), or a
directory under the operator's model root (CANARY_MODEL_ROOT), and with
CANARY_MODEL_ROOT_PER_PROJECT under `<root>/<project>/` or `<root>/_shared/` only. Otherwise one
team could name another team's private weights and read generations of them.

The check is on the real path: symlinks, `..` and `/proc/self/root` are resolved first, a path
through /proc is refused outright (`/proc/<pid>/root` enters another process's mount namespace,
which a string-level resolution cannot see), and the resolved directory must be the very file
the given path opens (same device and inode). Checked when a model or config is created (API,
`canary run -f`) and again by the worker, which loads the real path it checked.

Without a root: any local directory in dev and test (a laptop, the tests), none in production
(builtin models only, until the operator sets CANARY_MODEL_ROOT).

Every refusal of a local path reads the same ("not a usable path to a model directory"), so the
API does not tell what exists on its host.
"""

from __future__ import annotations

import os
import pathlib

SHARED = "_shared"  # <root>/_shared/: models every project may use (no project name starts with "_")
ENDPOINT_PREFIXES = ("http://", "https://")


def is_endpoint(path: str) -> bool:
    """A served model's URL (engine openai), not a directory."""
    return path.startswith(ENDPOINT_PREFIXES)


def unusable(field: str, path: str, project: str | None = None) -> ValueError:
    """One answer for every local path that is not a model directory the project may read —
    missing, no config.json, outside the root, a symlink out, unreadable, too long."""
    shown = path if len(path) <= 80 else path[:77] + "..."
    where = ", ".join(f"{folder}/" for folder in allowed_folders(project)) if _root() else ""
    return ValueError(f"{field}: '{shown}' is not a usable path to a model directory on the server (a Hugging Face "
                      f"directory with config.json{f' under {where}' if where else ''}); give one, or "
                      "builtin:pydoc-target")


def _root() -> pathlib.Path | None:
    from app.settings import get_settings

    root = get_settings().model_root
    return pathlib.Path(os.path.realpath(os.path.expanduser(root))) if root else None


def allowed_folders(project: str | None) -> list[pathlib.Path]:
    """The directories a project's model paths must resolve under (none without a root)."""
    from app.settings import get_settings

    root = _root()
    if root is None:
        return []
    if get_settings().model_root_per_project and project is not None:
        return [root / project, root / SHARED]
    return [root]


def confined_dir(path: str, field: str, project: str | None = None) -> pathlib.Path:
    """The real path of the local directory `path` names, or ValueError when the project may not
    read it (builtin: and endpoint paths are not local: model_dir handles them)."""
    from app.settings import get_settings

    if _root() is None and get_settings().environment == "production":
        raise ValueError(f"{field}: local model directories are read only under the operator's model root, and "
                         "CANARY_MODEL_ROOT is not set on this server; use builtin:pydoc-target, or ask the operator "
                         "to set CANARY_MODEL_ROOT")
    given = pathlib.Path(os.path.expanduser(path))
    try:
        real = pathlib.Path(os.path.realpath(given))
        seen, resolved = os.stat(given), os.stat(real)
    except (OSError, ValueError):  # missing, unreadable, a loop, a NUL byte
        raise unusable(field, path, project) from None
    folders = allowed_folders(project)
    inside = not folders or any(real.is_relative_to(folder) for folder in folders)
    through_proc = any(p.parts[:2] == ("/", "proc") for p in (given.absolute(), real))
    # a magic link (/proc/<pid>/root) resolves to one name and opens another file
    same_file = (seen.st_dev, seen.st_ino) == (resolved.st_dev, resolved.st_ino)
    if not inside or through_proc or not same_file:
        raise unusable(field, path, project)
    return real


def model_dir(path: str, field: str, project: str | None = None) -> pathlib.Path:
    """The directory to load a model (or draft) from: the zoo's for builtin:NAME, else the checked
    real path of a local Hugging Face directory; ValueError naming the field otherwise (a URL too:
    only engine openai serves one, and it is never loaded)."""
    from engines.zoo import ModelPathError, resolve_model_path

    if path.startswith("builtin:"):  # the zoo's own names: nothing on the host is revealed
        try:
            return resolve_model_path(path)
        except ModelPathError as e:
            raise ValueError(f"{field}: {e}") from None
    if is_endpoint(path):
        raise unusable(field, path, project)
    real = confined_dir(path, field, project)
    try:
        return resolve_model_path(str(real))
    except (ModelPathError, OSError):
        raise unusable(field, path, project) from None
