#!/bin/sh
# Run once by the postgres image when docker-compose.yml's stack first initialises its database:
# gives Grafana's read-only role a login and a password. The collector's migration 0004 then finds
# the role present and grants it SELECT on the qkwatch_*_v views, and nothing else.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    --set=password="${QKWATCH_GRAFANA_DB_PASSWORD:?set QKWATCH_GRAFANA_DB_PASSWORD}" <<'SQL'
CREATE ROLE qkwatch_grafana LOGIN PASSWORD :'password';
SQL
