"""Kubernetes naming rules, and the labels and annotations the backend puts on its objects.

Every object name and label value the backend derives from an app is checked here, in the dry run,
so that a name the API server would reject fails early with a message naming the role and the value.
"""

from __future__ import annotations

import re

MAX_LABEL = 63
MAX_SUBDOMAIN = 253

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")

DOMAIN = "asynctorchx.dev"

# Labels (selectable) on the Service, the Jobs and the pod templates.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "asynctorchx"
LABEL_APP_ID = f"{DOMAIN}/app-id"
LABEL_ROLE = f"{DOMAIN}/role-name"
LABEL_VERSION = f"{DOMAIN}/version"
LABEL_APP_ATTEMPT = f"{DOMAIN}/app-attempt"
LABEL_ROLE_ATTEMPT = f"{DOMAIN}/role-attempt"

# Kueue (https://kueue.sigs.k8s.io): a Job with this label (a LocalQueue's name) is queued by Kueue,
# which expects it created suspended and unsuspends it once the queue admits it.
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"

# Annotations (free text): what cannot be a label value.
ANN_APP_NAME = f"{DOMAIN}/app-name"
ANN_SESSION = f"{DOMAIN}/session"
ANN_ROLES = f"{DOMAIN}/roles"
ANN_ROLE = f"{DOMAIN}/role"
ANN_ROLE_INDEX = f"{DOMAIN}/role-index"
# On the Service while a ROLE or APPLICATION restart is under way (or failed): which roles, the
# attempts they are recreated as, when it began (refreshed while it waits) and why it failed.
ANN_RESTART = f"{DOMAIN}/restart"

# Set by the Job controller on the pods of an Indexed Job.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
INDEX_FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
INDEX_IGNORED_FAILURE_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"

APP_ID_SUFFIX_LENGTH = 8
APP_ID_MAX_LENGTH = 40
# The shortest app id make_unique can produce: one letter, a dash and the random suffix.
APP_ID_MIN_LENGTH = APP_ID_SUFFIX_LENGTH + 2


def is_dns1123_label(value: str) -> bool:
    """True for a lowercase RFC 1123 label of at most 63 characters (pod hostnames, Job names)."""
    return len(value) <= MAX_LABEL and _DNS1123_LABEL.fullmatch(value) is not None


def is_dns1035_label(value: str) -> bool:
    """True for an RFC 1035 label of at most 63 characters (Service names: starts with a letter)."""
    return len(value) <= MAX_LABEL and _DNS1035_LABEL.fullmatch(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    """True for a lowercase RFC 1123 subdomain of at most 253 characters (namespaced object names)."""
    return len(value) <= MAX_SUBDOMAIN and _DNS1123_SUBDOMAIN.fullmatch(value) is not None


def is_label_value(value: str) -> bool:
    """True for a valid label value: empty, or at most 63 of ``[A-Za-z0-9_.-]``, alphanumeric ends."""
    return len(value) <= MAX_LABEL and _LABEL_VALUE.fullmatch(value) is not None


def is_label_key(key: str) -> bool:
    """True for a valid label (or annotation) key: an optional DNS subdomain prefix and a name."""
    prefix, sep, name = key.rpartition("/")
    if sep and not (prefix and is_dns1123_subdomain(prefix)):
        return False
    return len(name) <= MAX_LABEL and _LABEL_NAME.fullmatch(name) is not None


def is_port_name(value: str) -> bool:
    """True for an IANA service name: at most 15 characters, with a letter, no ``--``."""
    return (
        len(value) <= 15
        and _PORT_NAME.fullmatch(value) is not None
        and "--" not in value
        and any(c.isalpha() for c in value)
    )


def is_env_name(value: str) -> bool:
    """True for an environment variable name every supported Kubernetes version accepts."""
    return _ENV_NAME.fullmatch(value) is not None


def role_dns_name(role_name: str) -> str:
    """The DNS-label form of a role name: lowercase, runs of other characters become one ``-``.

    Returns an empty string when nothing usable is left.
    """
    name = re.sub(r"[^a-z0-9]+", "-", role_name.lower()).strip("-")
    return name[:MAX_LABEL].rstrip("-")


def job_name(app_name: str, role_dns: str) -> str:
    """The name of a role's Job (also the prefix of its pods' hostnames)."""
    return f"{app_name}-{role_dns}"


def pod_hostname(app_name: str, role_dns: str, index: int) -> str:
    """The hostname of replica ``index`` of a role (set by the Job controller for Indexed Jobs)."""
    return f"{job_name(app_name, role_dns)}-{index}"


def app_id_budget(roles: list[tuple[str, int]]) -> int:
    """The longest app name for which every derived name of ``roles`` fits in 63 characters.

    Args:
        roles: ``(role DNS name, num_replicas)`` pairs.
    """
    longest = max(len(f"-{dns}-{max(n - 1, 0)}") for dns, n in roles)
    return MAX_LABEL - longest


def make_app_id(namespace: str, name: str) -> str:
    """The backend's app id ``{namespace}:{name}``."""
    return f"{namespace}:{name}"


def split_app_id(app_id: str) -> tuple[str, str] | None:
    """``(namespace, name)`` of an app id, or None when ``app_id`` is not one of ours."""
    namespace, sep, name = app_id.partition(":")
    if not sep or not is_dns1123_label(namespace) or not is_dns1035_label(name):
        return None
    return namespace, name
