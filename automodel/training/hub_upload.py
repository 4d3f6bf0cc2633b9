"""``export.push_to_hub``: checked before the run starts, and uploaded once the export is on disk.

Before launch (:func:`check_push_to_hub`, called by ``prelaunch``): the repo name is valid, the hub is not switched
off (``HF_HUB_OFFLINE``), a token is there, and the hub answers ``whoami`` with it (a token that can write). A run
that would train for hours and then fail to upload is refused in seconds, with exit status 2.

After the export: under the ``automodel`` command, rank 0 leaves the upload to the command (:func:`publish` writes a
request into the file the command names in ``AUTOMODEL_UPLOAD_REQUEST``), which uploads once every training process
has ended, so no rank waits in a collective while rank 0 uploads. The command first says where the export is on
disk; a failed upload then ends it with ``EXIT_UPLOAD_FAILED`` (3), not the status of a failed training. Run
otherwise (``run(config)``, plain ``torchrun``), rank 0 uploads itself and raises :class:`UploadError` on failure.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from .commands import EXIT_UPLOAD_FAILED
from .config_errors import ConfigError

__all__ = [
    "UPLOAD_REQUEST_VARIABLE",
    "UploadError",
    "check_push_to_hub",
    "finish_requested_upload",
    "publish",
    "upload",
]

#: The file the ``automodel`` command asks rank 0 to write its upload request into (JSON: directory, repo_id).
UPLOAD_REQUEST_VARIABLE = "AUTOMODEL_UPLOAD_REQUEST"
#: How long the pre-launch check waits for the hub's answer (huggingface_hub itself waits forever).
ANSWER_TIMEOUT_S = 30.0


class UploadError(RuntimeError):
    """The export is written; its upload to the hub failed. The message says where the export is, and how to upload
    it later."""


def check_push_to_hub(repo_id: str, export_dir: str | None, *, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """Raise :class:`ConfigError` (naming ``export.push_to_hub`` and the fix) when ``repo_id`` could not be uploaded to
    from here: an invalid repo name, the hub switched off, no token, a token the hub refuses or one that can only
    read, or a hub that does not answer (within ``timeout_s``)."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    key = f"export.push_to_hub={repo_id}"
    later = f"or drop export.push_to_hub and upload export.dir afterwards: hf upload {repo_id} {export_dir or 'DIR'}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ConfigError(
            f"{key} is not a valid repo name ({error}); write NAMESPACE/NAME, e.g. my-org/my-model."
        ) from None
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{key}: the hub is switched off here (HF_HUB_OFFLINE=1), so the upload would fail after "
                          f"training. Unset HF_HUB_OFFLINE, {later}.")  # fmt: skip
    token = get_token()
    if token is None:
        raise ConfigError(f"{key} needs a Hugging Face token that can write: run `hf auth login` or set HF_TOKEN, "
                          f"{later}.")  # fmt: skip
    answer = _whoami(token, timeout_s)
    if isinstance(answer, BaseException):
        raise ConfigError(
            f"{key}: the hub ({constants.ENDPOINT}) did not accept the token or cannot be reached from here "
            f"({type(answer).__name__}: {_first_line(answer)}), so the upload would fail after training. Fix the "
            f"token or the connection, {later}."
        )
    if answer is None:
        raise ConfigError(f"{key}: the hub ({constants.ENDPOINT}) did not answer within {timeout_s:.0f} s, so the "
                          f"upload would likely fail after training. Check the connection, {later}.")  # fmt: skip
    role = answer.get("auth", {}).get("accessToken", {}).get("role")
    if role == "read":
        raise ConfigError(f"{key}: the token of {answer.get('name', 'this user')} can only read; create one that can "
                          f"write (https://huggingface.co/settings/tokens), {later}.")  # fmt: skip


def _whoami(token: str, timeout_s: float) -> dict[str, Any] | BaseException | None:
    """The hub's ``whoami`` answer for ``token``, the error it raised, or ``None`` when it did not answer in time (the
    call goes on in a daemon thread, which the process does not wait for)."""
    from huggingface_hub import HfApi

    outcome: list[Any] = []

    def ask() -> None:
        try:
            outcome.append(HfApi().whoami(token=token))
        except Exception as error:  # returned: the caller says what it means
            outcome.append(error)

    thread = threading.Thread(target=ask, name="automodel-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def publish(directory: Path, repo_id: str) -> None:
    """On rank 0 (others return at once; no collective): under the ``automodel`` command, ask it to upload
    ``directory`` once the run has ended; else upload it now (:func:`upload`)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    request = os.environ.get(UPLOAD_REQUEST_VARIABLE)
    if request:
        Path(request).write_text(json.dumps({"directory": str(directory), "repo_id": repo_id}))
        return
    upload(directory, repo_id)


def upload(directory: Path, repo_id: str) -> str:
    """Upload the export ``directory`` to ``repo_id``; the commit URL. A failure raises :class:`UploadError`, which
    says that the export is on disk and how to upload it later."""
    from automodel.loading.export import push_to_hub

    try:
        return push_to_hub(directory, repo_id)
    except Exception as error:
        raise UploadError(
            f"the export is on disk in {directory}, but uploading it to {repo_id} failed: {type(error).__name__}: "
            f"{_first_line(error)}. Upload it when the hub is reachable: hf upload {repo_id} {directory}"
        ) from error


def finish_requested_upload(request_file: Path, recipe: str) -> int | None:
    """In the ``automodel`` command, after the training processes ended well: the upload rank 0 asked for, if any.
    Prints where the export is, then the upload's outcome; ``None`` without a request, 0 when uploaded,
    ``EXIT_UPLOAD_FAILED`` when the upload failed."""
    if not request_file.is_file():
        return None
    request = json.loads(request_file.read_text())
    directory, repo_id = Path(request["directory"]), request["repo_id"]
    print(f"automodel {recipe}: the export is on disk in {directory}; uploading it to {repo_id}", file=sys.stderr)
    try:
        url = upload(directory, repo_id)
    except UploadError as error:
        print(f"automodel {recipe}: upload failed: {error}", file=sys.stderr, flush=True)
        return EXIT_UPLOAD_FAILED
    print(f"automodel {recipe}: uploaded to {url}", file=sys.stderr, flush=True)
    return 0
