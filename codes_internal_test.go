package idempotency

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Each outcome of the layer maps to its documented code and details, and
// survives the trip to a client as a status. Every retryable one carries a
// RetryInfo once the gRPC server stamped it with the store's delay;
// KEY_IN_PROGRESS always does.
func TestUnitErrorStatus(t *testing.T) {
	t.Parallel()
	serialization := handlerError(&pgconn.PgError{Code: sqlSerializationFailure})
	for _, tc := range []struct {
		err     error
		code    codes.Code
		reason  string        // ErrorInfo's; "" for none
		delay   time.Duration // RetryInfo's
		details []string      // detail types besides ErrorInfo
	}{
		{inProgress("", 123*time.Millisecond), codes.Aborted, "KEY_IN_PROGRESS", 123 * time.Millisecond, []string{"RetryInfo"}},
		{ErrKeyReused.with("", nil).about("k"), codes.FailedPrecondition, "KEY_REUSED", 0, []string{"PreconditionFailure"}},
		{invalidKey(MetadataKey, "bad"), codes.InvalidArgument, "INVALID_KEY", 0, []string{"BadRequest"}},
		{ErrMissingKey.with("", nil).about(MetadataKey), codes.InvalidArgument, "MISSING_KEY", 0, []string{"BadRequest"}},
		{ErrStoreUnavailable.with("claim", errors.New("secret host db-7")), codes.Unavailable, "STORE_UNAVAILABLE", 0, nil},
		{withSuggestedDelay(ErrStoreUnavailable.with("claim", nil), 3*time.Second), codes.Unavailable, "STORE_UNAVAILABLE", 3 * time.Second, []string{"RetryInfo"}},
		{serialization, codes.Aborted, "", 0, nil},
		{withSuggestedDelay(serialization, 0), codes.Aborted, "", 0, []string{"RetryInfo"}},
		{withSuggestedDelay(inProgress("", 123*time.Millisecond), time.Hour), codes.Aborted, "KEY_IN_PROGRESS", 123 * time.Millisecond, []string{"RetryInfo"}},
		{ErrChainOrder.with("/m", nil), codes.Internal, "CHAIN_ORDER", 0, nil},
		{ErrAttemptTimeout.with("/m", nil), codes.DeadlineExceeded, "ATTEMPT_TIMEOUT", 0, nil},
		{ErrStreamingUnsupported.with("/m", nil), codes.Unimplemented, "STREAMING_UNSUPPORTED", 0, nil},
	} {
		st := status.Convert(tc.err)
		name := tc.reason + " " + st.Message()
		require.Equal(t, tc.code, st.Code(), name)
		var got []string
		reason := ""
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				require.Equal(t, ErrorDomain, d.GetDomain())
				reason = d.GetReason()
			case *errdetails.RetryInfo:
				require.Equal(t, tc.delay, d.GetRetryDelay().AsDuration(), name)
				got = append(got, "RetryInfo")
			case *errdetails.PreconditionFailure:
				require.Equal(t, "k", d.GetViolations()[0].GetSubject())
				got = append(got, "PreconditionFailure")
			case *errdetails.BadRequest:
				require.Equal(t, MetadataKey, d.GetFieldViolations()[0].GetField())
				got = append(got, "BadRequest")
			default:
				t.Fatalf("%s: unexpected detail %T", name, d)
			}
		}
		require.Equal(t, tc.reason, reason, name)
		require.Equal(t, tc.details, got, name)
		require.NotContains(t, st.Message(), "secret", "causes stay on the server")
	}

	// A stamp never touches what is not a retryable outcome of the layer:
	// a handler's own status, a sentinel itself.
	own := status.Error(codes.Unavailable, "provider down")
	require.Same(t, own, withSuggestedDelay(own, time.Second))
	_, ok := RetryDelay(withSuggestedDelay(own, time.Second))
	require.False(t, ok, "a handler's own Unavailable gets no RetryInfo of the layer")
	key := invalidKey(MetadataKey, "bad")
	require.Same(t, key, withSuggestedDelay(key, time.Second))
	_ = withSuggestedDelay(ErrStoreUnavailable, time.Hour)
	_, ok = RetryDelay(ErrStoreUnavailable)
	require.False(t, ok, "the sentinel is copied, not changed")
	// Not stamped (Store.Execute, a consumer): no RetryInfo, so that a
	// consumer's own backoff decides; KEY_IN_PROGRESS has its own.
	_, ok = RetryDelay(ErrStoreUnavailable.with("claim", nil))
	require.False(t, ok)

	// On the client, errors arrive as statuses.
	wire := status.ErrorProto(status.Convert(inProgress("", time.Second)).Proto())
	require.True(t, IsInProgress(wire))
	require.False(t, IsKeyReused(wire))
	d, ok := RetryDelay(wire)
	require.True(t, ok)
	require.Equal(t, time.Second, d)
	require.True(t, IsKeyReused(status.ErrorProto(status.Convert(ErrKeyReused).Proto())))
	require.False(t, IsInProgress(status.Error(codes.Aborted, "someone else's Aborted")))
	_, ok = RetryDelay(errors.New("plain"))
	require.False(t, ok)

	// errors.Is matches the sentinel, whatever the detail.
	require.ErrorIs(t, fmt.Errorf("wrapped: %w", invalidKey("f", "x")), ErrInvalidKey)
	require.False(t, errors.Is(invalidKey("f", "x"), ErrKeyReused))
}

func TestUnitFinal(t *testing.T) {
	t.Parallel()
	require.NoError(t, Final(nil))
	base := status.Error(codes.NotFound, "no such account")
	f := Final(base)
	require.True(t, IsFinal(f))
	require.True(t, IsFinal(fmt.Errorf("context: %w", f)))
	require.False(t, IsFinal(base))
	require.Equal(t, codes.NotFound, status.Code(f), "the mark keeps the status")
	require.Same(t, base, unwrapFinal(f))
	require.Same(t, base, unwrapFinal(base))

	ctxErr := contextError{context.DeadlineExceeded}
	require.ErrorIs(t, ctxErr, context.DeadlineExceeded)
	require.Equal(t, codes.DeadlineExceeded, status.Code(ctxErr))
}

func TestUnitOutcomeNames(t *testing.T) {
	t.Parallel()
	want := map[Outcome]string{
		OutcomeExecuted: "executed", OutcomeReplayed: "replayed", OutcomeReleased: "released",
		OutcomeInProgress: "in_progress", OutcomeKeyReused: "key_reused", OutcomeRejected: "rejected",
		OutcomeUnavailable: "unavailable", OutcomeCanceled: "canceled", OutcomeMisconfigured: "misconfigured",
		0: "unknown", 99: "unknown",
	}
	for o, name := range want {
		require.Equal(t, name, o.String())
	}
}

// What a consumer does with a message: a permanent failure is never
// redelivered, a database problem always is.
func TestUnitDisposition(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		outcome Outcome
		err     error
		want    Disposition
	}{
		{OutcomeExecuted, nil, Ack},
		{OutcomeReplayed, nil, Ack},
		{OutcomeExecuted, Final(status.Error(codes.InvalidArgument, "poison")), DeadLetter},
		{OutcomeReplayed, Final(status.Error(codes.InvalidArgument, "poison")), DeadLetter},
		{OutcomeKeyReused, ErrKeyReused.with("", nil), DeadLetter},
		{OutcomeRejected, invalidKey("ID", "key is empty"), DeadLetter},
		{OutcomeReleased, errors.New("downstream down"), Redeliver},
		{OutcomeInProgress, inProgress("", time.Second), Redeliver},
		{OutcomeUnavailable, ErrStoreUnavailable.with("claim", nil), Redeliver},
		{OutcomeUnavailable, contextError{context.Canceled}, Redeliver},
	} {
		require.Equal(t, tc.want, DispositionOf(tc.outcome, tc.err), "%v %v", tc.outcome, tc.err)
	}
	require.Equal(t, "dead_letter", DeadLetter.String())
}
