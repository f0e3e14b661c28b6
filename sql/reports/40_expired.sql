-- Reservations whose lease ran out, and what their late settles reported.

-- The result gained late_usage_source: a changed result type needs the old
-- function gone first.
DROP FUNCTION IF EXISTS reporting.expired_reservations(date, date, text);
CREATE OR REPLACE FUNCTION reporting.expired_reservations(
    p_from date, p_to date, p_tenant text DEFAULT NULL
) RETURNS TABLE (
    expired_at         timestamptz,
    tenant             text,
    route              text,
    model              text,
    reservation_id     uuid,
    reserved_tokens    bigint,
    policy_version     bigint,
    late_settled_at    timestamptz,
    late_input_tokens  bigint,
    late_output_tokens bigint,
    late_cost_usd      numeric,
    -- where the late settle's figures came from: reported | clamped | counted
    late_usage_source  text
)
LANGUAGE sql STABLE
AS $$
    -- Expired in the period; the late columns are filled when usage arrived
    -- afterwards (whenever that was), NULL while it has not.
    SELECT o.recorded_at, o.tenant, o.route, o.model, o.reservation_id,
           o.reserved_tokens, o.policy_version, o.late_recorded_at,
           o.late_input_tokens, o.late_output_tokens, trim_scale(o.late_cost_usd),
           o.late_usage_source
      FROM reporting.reservation_outcomes AS o
     WHERE o.outcome = 'expired'
       AND o.recorded_at >= reporting.utc_start(p_from)
       AND o.recorded_at < reporting.utc_start(p_to)
       AND (p_tenant IS NULL OR o.tenant = p_tenant)
     ORDER BY o.recorded_at, o.reservation_id
$$;
COMMENT ON FUNCTION reporting.expired_reservations(date, date, text) IS
    'expired reservations with the reserved amount, and their late settle (usage, cost) if one came';
