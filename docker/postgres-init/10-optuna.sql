-- Run once by the postgres image on an empty data volume (files in /docker-entrypoint-initdb.d/).
-- POSTGRES_DB=mlflow creates MLflow's database; Optuna gets its own: both keep an Alembic `alembic_version`
-- table, so they clash in one database.
CREATE DATABASE optuna;
