"""The argument names of the managed training-session service, mapped onto ours.

Loops written for the managed service (its ServiceClient and create_lora_training_client)
run here with their own argument names where those mean something on a self-hosted server:

| managed service            | treadle                          |
|----------------------------|----------------------------------|
| model_package_group_arn    | model_package_group (the ARN's last path element, or a name) |
| s3_output_path             | output_path                      |

The ones that describe the managed service's own infrastructure have no meaning here and are
refused with an error naming them (NO_MEANING), rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

NO_MEANING = {
    "role_arn": "the server reaches its object store with its own credentials (the boto3 "
    "environment it runs with); there is no role to pass",
    "region": "a self-hosted server runs where you started it; point base_url at it",
    "vpc_config": "the server's network is wherever you run it",
    "subnets": "the server's network is wherever you run it",
    "security_group_ids": "the server's network is wherever you run it",
    "kms_key_arn": "versions are encrypted with ServiceClient(encryption_key=...) instead",
}


def package_group(arn_or_name: str) -> str:
    """`arn:...:model-package-group/NAME` → NAME; a plain name stays as it is."""
    name = arn_or_name.rstrip("/").rsplit("/", 1)[-1]
    if not name or name.startswith("arn:"):
        raise ValueError(
            "model_package_group_arn: expected an ARN ending in /<group name>, or a group "
            f"name, got {arn_or_name!r}"
        )
    return name


def ported_target(
    where: str,
    model_package_group: str | None,
    output_path: str | None,
    model_package_group_arn: str | None,
    s3_output_path: str | None,
    others: dict[str, Any],
) -> tuple[str | None, str | None]:
    """(model_package_group, output_path) from ours or their managed-service aliases; raise
    TypeError naming any other argument (`others`: the **kwargs catch-all of `where`)."""
    for name in others:
        if name in NO_MEANING:
            raise TypeError(
                f"{where}: {name!r} has no meaning on a self-hosted Treadle server "
                f"({NO_MEANING[name]}); remove it"
            )
        raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
    if model_package_group_arn is not None:
        alias = package_group(model_package_group_arn)
        if model_package_group not in (None, alias):
            raise TypeError(
                f"{where}: model_package_group {model_package_group!r} and "
                f"model_package_group_arn {model_package_group_arn!r} name different groups"
            )
        model_package_group = alias
    if s3_output_path is not None:
        if output_path not in (None, s3_output_path):
            raise TypeError(
                f"{where}: output_path {output_path!r} and s3_output_path {s3_output_path!r} "
                "differ; give one"
            )
        output_path = s3_output_path
    return model_package_group, output_path
