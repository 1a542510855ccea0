"""Carrying one build to many machines: the tiered store and its one fleet journey
(``tiered``), remote stores behind the ``Remote`` protocol (``remote_api``: S3 in ``remote``, OCI
registries in ``oci``), push and pull (``sync``), compile leases (``lease``), signatures and the
trust policy (``trust``), and bundles (``bundle``)."""
