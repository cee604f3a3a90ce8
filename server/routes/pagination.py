"""Cursor pagination shared by the list routes: order by (created_at, id), resume after an id."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

from server.errors import bad_request

Row = TypeVar("Row", bound=Any)


def page(
    session: Session,
    model: type[Row],
    project: str,
    *filters: Any,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"] = "desc",
) -> tuple[list[Row], bool]:
    """One page of the project's rows matching `filters`, and whether more follow. `after` must
    name one of the project's rows (else 400, param `after`); it need not match `filters`."""
    stmt: Select[Any] = select(model).where(model.project == project, *filters)
    if after is not None:
        anchor = session.scalars(
            select(model).where(model.id == after, model.project == project)
        ).first()
        if anchor is None:
            raise bad_request(
                f"Invalid 'after': no object with id '{after}' in this list.",
                param="after",
                code="invalid_value",
            )
        if order == "desc":
            stmt = stmt.where(
                or_(
                    model.created_at < anchor.created_at,
                    and_(model.created_at == anchor.created_at, model.id < anchor.id),
                )
            )
        else:
            stmt = stmt.where(
                or_(
                    model.created_at > anchor.created_at,
                    and_(model.created_at == anchor.created_at, model.id > anchor.id),
                )
            )
    if order == "desc":
        stmt = stmt.order_by(model.created_at.desc(), model.id.desc())
    else:
        stmt = stmt.order_by(model.created_at.asc(), model.id.asc())
    rows = list(session.scalars(stmt.limit(limit + 1)))
    return rows[:limit], len(rows) > limit
