"""A user's own page (API tokens: made, shown once, revoked) and the sweep pages (a sweep's
members and their curves on one chart). Thin interfaces over the services and selectors."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.contrib.auth.models import User
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dartboard import figures
from dartboard.forms import TokenForm
from datamanager.models import ApiToken, EvalScope
from datamanager.roles import CAN_VIEW
from datamanager.selectors.accounts import api_tokens, sweep_find, sweeps_listing
from datamanager.selectors.metrics import sweep_curves
from datamanager.services import tokens


def _user(request: HttpRequest) -> User:
    assert isinstance(request.user, User)  # LoginRequiredMiddleware turns anonymous away
    return request.user


@require_http_methods(["GET", "POST"])
def account(request: HttpRequest) -> HttpResponse:
    """Your API tokens. A new token is shown in this response only: it is stored hashed."""
    user = _user(request)
    form = TokenForm(request.POST or None)
    created = None
    status = 200
    if request.method == "POST":
        if form.is_valid():
            try:
                created = tokens.api_token_create(
                    user=user, name=form.cleaned_data["name"], days=form.cleaned_data["days"]
                )
            except tokens.TokenInvalid as exc:
                form.add_error(None, str(exc))
                status = 400
            else:
                form = TokenForm()
        else:
            status = 400
    rows = api_tokens(user=user)
    response = render(
        request,
        "dashboard/account.html",
        {"form": form, "created": created, "tokens": rows},
        status=status,
    )
    response["Cache-Control"] = "no-store"  # the new token must not stay in a cache
    return response


@require_POST
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    try:
        token = tokens.api_token_revoke(token_id=token_id, user=_user(request))
    except ApiToken.DoesNotExist:
        raise Http404(f"you have no token {token_id}") from None
    messages.success(request, f"Token {token.name} revoked: requests with it are refused.")
    return redirect("account")


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def sweep_list(request: HttpRequest) -> HttpResponse:
    sweeps = sweeps_listing()[:200]
    return render(request, "dashboard/sweeps.html", {"sweeps": sweeps})


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def sweep_detail(request: HttpRequest, sweep_id: int) -> HttpResponse:
    """A sweep's members (their values, status, latest greedy success) and their curves."""
    sweep = sweep_find(sweep_id=sweep_id)
    if sweep is None:
        raise Http404(f"no sweep {sweep_id}")
    curves = sweep_curves(sweep_id=sweep.pk)
    scopes = [s for s in EvalScope.values if any(c.versions.get(s) for c in curves)]
    return render(
        request,
        "dashboard/sweep_detail.html",
        {
            "sweep": sweep,
            "curves": curves,
            "figures": [(s, figures.sweep_figure(curves, s)) for s in scopes],
        },
    )
