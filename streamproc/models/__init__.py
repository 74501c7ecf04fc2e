"""Versioned models of a pipeline: where versions come from (a model repository folder, MLflow's
model registry), loading and warming a version up beside the serving one, the switch at a batch
boundary, shadow scoring, probation and automatic rollback, and the admin endpoint's handler.

Below the stages in the flow: the dispatcher binds each cut batch to the version that serves
it (:class:`~streamproc.models.versions.ModelVersions`), the device worker runs it, the result
handler stamps the version into the result's ``streamproc.model.version`` header.
"""
