"""The image fetcher a deployment's worker uses for one job's rows."""

from __future__ import annotations

from collections.abc import Callable

from bulkinfer.jobs.image_rules import image_read_rule
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.images.fetcher import ImageFetcher
from bulkinfer.worker.images.stores import StoreOpener


def job_image_fetcher(settings: Settings, spec: JobSpec, *,
                      upload_owner: Callable[[str], str | None] | None = None) -> ImageFetcher:
    """The deployment's image limits and S3 endpoint, and the tenant rules of `input_uri` for the
    job's tenant (`spec.tenant`) on every store location. `upload_owner(job_id)`: the tenant of a
    job, to let rows name their tenant's uploads (e.g. `lambda job_id:
    repository.get_spec(job_id).tenant`); without it they may not. Close it when the job's rows are
    done (it may hold an http client)."""
    return ImageFetcher(StoreOpener(settings.s3_endpoint_url), settings.image_limits(),
                        may_read=image_read_rule(settings, spec.tenant, upload_owner))
