"""Every Redis key and channel name patchserve uses. No other module spells a key.

All names start with a configurable prefix (default ``patchserve:``) so several deployments can share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "patchserve:"


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = DEFAULT_PREFIX

    # --- registry ------------------------------------------------------------------------------------------
    @property
    def tasks(self) -> str:
        """Set of registered task names."""
        return f"{self.prefix}tasks"

    @property
    def task_names(self) -> str:
        """Sorted set of the same names, every score 0: ordered by name, for keyset paging (ZRANGEBYLEX)."""
        return f"{self.prefix}tasks:by-name"

    def task(self, name: str) -> str:
        """Hash {current, last}: the current version and the last version number handed out."""
        return f"{self.prefix}task:{name}"

    def versions(self, name: str) -> str:
        """Hash version -> VersionInfo JSON."""
        return f"{self.prefix}task:{name}:versions"

    def retired(self, name: str) -> str:
        """Hash version -> Unix time it stopped being current (retention keeps such a version a while)."""
        return f"{self.prefix}task:{name}:retired"

    def blob(self, name: str, version: int) -> str:
        """Patch bytes of one version."""
        return f"{self.prefix}task:{name}:blob:{version}"

    @property
    def generation(self) -> str:
        """Counter bumped by every registry change."""
        return f"{self.prefix}generation"

    @property
    def change_log(self) -> str:
        """Stream of changed task names (field ``task``), one entry per generation step, trimmed to about
        ``CHANGE_LOG_LENGTH`` entries: lets watchers read only what changed."""
        return f"{self.prefix}changes:log"

    @property
    def changes(self) -> str:
        """Pub/sub channel announcing registry changes (payload: task name)."""
        return f"{self.prefix}changes"

    # --- training jobs -------------------------------------------------------------------------------------
    @property
    def job_stream(self) -> str:
        """Stream of job ids; workers read it through the consumer group ``JOB_GROUP``."""
        return f"{self.prefix}jobs:stream"

    @property
    def job_index(self) -> str:
        """Sorted set of job ids by submission time (for listing)."""
        return f"{self.prefix}jobs:index"

    def job(self, job_id: str) -> str:
        """Hash of one job's record (status, config, progress, result, error ...)."""
        return f"{self.prefix}job:{job_id}"

    def job_file(self, job_id: str, name: str) -> str:
        """Bytes of one of a job's data files (train, dev, test)."""
        return f"{self.prefix}job:{job_id}:file:{name}"


JOB_GROUP = "patchserve-workers"
CHANGE_LOG_LENGTH = 10_000
