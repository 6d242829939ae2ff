"""What an operator needs to watch a deployment: Prometheus scrape targets that pdserve keeps
current (:mod:`.targets`), the scrape config and a Prometheus it can start
(:mod:`.prometheus`, ``pdserve dev --observability``), recording rules (``rules.yml``) and a
Grafana dashboard (``dashboard.json``, generated from :mod:`.dashboard`)."""
