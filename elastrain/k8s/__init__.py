"""elastrain on Kubernetes: manifests (JobSet + Kueue), offline validation, cluster ops.

- `config.K8sConfig`: what a job's manifests are made from (validated).
- `render.render(cfg)`: the objects as dicts; `render.to_yaml` for kubectl.
- `validate.validate(objs)`: offline schema checks (kubernetes-validate, CRD schemas).
- `cluster`: `elastrain k8s status` and `elastrain k8s chaos` via the kubernetes client.

Only `config` and `render` import nothing beyond the standard library (PyYAML
for `to_yaml`); see docs/guide/kubernetes.md.
"""
