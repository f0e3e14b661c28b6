# The llmquota service image: the API (`llmquota serve`) and the sweeper
# (`llmquota sweep --loop`) run from it; compose.yaml wires them to PostgreSQL.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY src ./src
COPY sql ./sql
COPY migrations ./migrations
# A regular (non-editable) install: the SQL and migrations ship inside the package.
RUN pip install . && useradd --system --create-home llmquota
USER llmquota
WORKDIR /home/llmquota
EXPOSE 8080
CMD ["llmquota", "serve", "--host", "0.0.0.0", "--port", "8080"]
