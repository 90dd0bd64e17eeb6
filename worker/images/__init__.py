"""Images of a row, read and decoded for the engine: `ImageFetcher.fetch(messages)` gives a row's
images (`RowImage`, RGB and loaded) in order of appearance, or raises `ImageRejected` naming the
part and the problem (that row's `invalid_image` error, never the job's).

Every read is bounded (`ImageLimits`: bytes, pixels, images per row, http hosts), and store
locations follow the job's `input_uri` rules (jobs/image_rules.py). `job_image_fetcher` builds the
fetcher a deployment's worker uses for one job.
"""

from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.worker.images.fetcher import ImageFetcher, ImageRejected, RowImage
from bulkinfer.worker.images.job_fetcher import job_image_fetcher
from bulkinfer.worker.images.stores import StoreOpener

__all__ = ["ImageFetcher", "ImageLimits", "ImageRejected", "RowImage", "StoreOpener", "job_image_fetcher"]
