"""Cloud storage: AWS S3 and Google Cloud Storage, for experiment files and aitoolbox 1.x's cloud classes.

- :mod:`aitoolbox.cloud.storage`: the storage interface, its errors and retries
  (:mod:`~aitoolbox.cloud.s3` on boto3, :mod:`~aitoolbox.cloud.gcs` on google-cloud-storage);
- :mod:`aitoolbox.cloud.uploader`: background uploads (:class:`~aitoolbox.cloud.uploader.CloudUploader`,
  :func:`~aitoolbox.cloud.uploader.uploader_for`);
- :mod:`aitoolbox.cloud.layout`: aitoolbox 1.8's key layout and finding checkpoints in a bucket;
- ``aitoolbox.cloud.AWS`` and ``aitoolbox.cloud.GoogleCloud``: aitoolbox 1.x's savers and loaders.

The service clients are optional (``pip install aitoolbox[aws]``, ``aitoolbox[gcs]``) and imported only when a
bucket is first used: importing these modules imports neither.
"""
# The cloud_save_mode values of aitoolbox 1.x.
s3_available_options = ["s3", "aws_s3", "aws"]
gcs_available_options = ["gcs", "google_storage", "google storage"]
