package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Every caller of a key gets the same answer: a handler's final error,
// whatever its shape, reaches the first caller exactly as it reaches every
// replay (code, message and details, byte for byte, and the error's text),
// through each transport that takes a handler's error.
func TestFinalErrorAnswersEveryCallerAlike(t *testing.T) {
	t.Parallel()
	for _, tr := range finalTransports() {
		t.Run(tr.name, func(t *testing.T) {
			t.Parallel()
			var runs atomic.Int64
			call := tr.start(t, &runs)
			for i, shape := range finalShapes() {
				t.Run(shape.name, func(t *testing.T) {
					key := fmt.Sprintf("final-%d", i)
					before := runs.Load()
					first, replayed := call(t, key, shape.err)
					require.False(t, replayed, "the first call ran")
					replay, replayed := call(t, key, errors.New("the handler ran again"))
					require.True(t, replayed, "the second call replayed")
					require.Equal(t, before+1, runs.Load(), "the handler ran once")
					require.Equal(t, shape.code, first.code, "the first answer: %s", first.text)
					require.Equal(t, first, replay, "the replay is the first answer")
				})
			}
		})
	}
}

// finalAnswer is what a caller got: the status as its client reads it,
// encoded, and the error's text.
type finalAnswer struct {
	code   codes.Code
	status []byte
	text   string
	final  bool // IsFinal, on the server's side
}

// finalCall calls a handler that returns err under key, and reports what
// the caller got, and whether the transport said it was replayed.
type finalCall func(t *testing.T, key string, err error) (a finalAnswer, replayed bool)

// finalTransport starts a server of its transport, and returns its
// finalCall.
type finalTransport struct {
	name  string
	start func(t *testing.T, runs *atomic.Int64) finalCall
}

func finalTransports() []finalTransport {
	serverSide := func(t *testing.T, outcome idempotency.Outcome, err error) (finalAnswer, bool) {
		t.Helper()
		require.Error(t, err)
		replayed := outcome == idempotency.OutcomeReplayed
		require.True(t, replayed || outcome == idempotency.OutcomeExecuted, "outcome %v: %v", outcome, err)
		return finalAnswer{code: status.Code(err), status: statusBytes(t, err), text: err.Error(), final: idempotency.IsFinal(err)}, replayed
	}
	return []finalTransport{
		{name: "Store.Execute", start: func(t *testing.T, runs *atomic.Int64) finalCall {
			store := migratedStore(t, testdb.New(t, 4))
			return func(t *testing.T, key string, fnErr error) (finalAnswer, bool) {
				res, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
					runs.Add(1)
					return nil, idempotency.Final(fnErr)
				})
				return serverSide(t, res.Outcome, err)
			}
		}},
		{name: "Store.ProcessMessage", start: func(t *testing.T, runs *atomic.Int64) finalCall {
			store := migratedStore(t, testdb.New(t, 4))
			return func(t *testing.T, key string, fnErr error) (finalAnswer, bool) {
				outcome, err := store.ProcessMessage(context.Background(), idempotency.Message{Scope: "s", ID: key}, func(context.Context, pgx.Tx) error {
					runs.Add(1)
					return idempotency.Final(fnErr)
				})
				require.Equal(t, idempotency.DeadLetter, idempotency.DispositionOf(outcome, err))
				return serverSide(t, outcome, err)
			}
		}},
		{name: "gRPC", start: func(t *testing.T, runs *atomic.Int64) finalCall {
			store := migratedStore(t, testdb.New(t, 4))
			var fnErr atomic.Pointer[error]
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
			srv.RegisterService(ledgerDesc(), &ledger{handler: func(context.Context, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
				runs.Add(1)
				return nil, idempotency.Final(*fnErr.Load())
			}})
			conn := dial(t, serve(t, srv))
			return func(t *testing.T, key string, err error) (finalAnswer, bool) {
				fnErr.Store(&err)
				var trailer metadata.MD
				ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
				err = conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Trailer(&trailer))
				require.Error(t, err)
				// What the client reads: the status, and its text.
				return finalAnswer{code: status.Code(err), status: statusBytes(t, err), text: err.Error()}, slices.Equal(trailer.Get(idempotency.ReplayedTrailer), []string{"true"})
			}
		}},
	}
}

// finalShape is an error a handler returns marked Final.
type finalShape struct {
	name string
	err  error
	code codes.Code // the answer's
}

func finalShapes() []finalShape {
	withDetails := func() *status.Status {
		st, err := status.New(codes.FailedPrecondition, "card expired").WithDetails(
			&errdetails.ErrorInfo{Reason: "CARD_EXPIRED", Domain: "payments.example.com", Metadata: map[string]string{"card": "4242"}},
			&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "card.expiry", Description: "in the past"}}})
		if err != nil {
			panic(err)
		}
		return st
	}
	return []finalShape{
		{name: "a plain error", err: errors.New("card declined"), code: codes.Unknown},
		{name: "a plain error wrapped with %w", err: fmt.Errorf("charge 42: %w", errors.New("card declined")), code: codes.Unknown},
		{name: "a status error", err: status.Error(codes.NotFound, "no such card"), code: codes.NotFound},
		{name: "a status error wrapped with %w", err: fmt.Errorf("charge 42: %w", status.Error(codes.NotFound, "no such card")), code: codes.NotFound},
		{name: "a status with details", err: withDetails().Err(), code: codes.FailedPrecondition},
		{name: "a status with details wrapped with %w", err: fmt.Errorf("charge 42: %w", withDetails().Err()), code: codes.FailedPrecondition},
		{name: "a status error whose message is not UTF-8", err: status.Error(codes.NotFound, "caf\xe9 card"), code: codes.NotFound},
		{name: "a context's error", err: context.DeadlineExceeded, code: codes.DeadlineExceeded},
		{name: "a context's error wrapped with %w", err: fmt.Errorf("the bank timed out: %w", context.Canceled), code: codes.Canceled},
		{name: "an error whose status is nil", err: statusError{text: "no status"}, code: codes.Unknown},
		{name: "an error whose status says OK", err: statusError{st: status.New(codes.OK, "all good"), text: "all good"}, code: codes.Unknown},
	}
}

// statusError is an error with a status of its own, which may be nil.
type statusError struct {
	st   *status.Status
	text string
}

func (e statusError) Error() string              { return e.text }
func (e statusError) GRPCStatus() *status.Status { return e.st }

// Unimplemented is not final: during a rolling deploy a replica that has the
// new method's stub but not its implementation answers Unimplemented; the
// retry, reaching a replica that implements it, must run the handler rather
// than replay the stub's answer for the key's TTL.
func TestPolicyUnimplementedDuringRollingDeployIsRetried(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)
	icpt := grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store))

	old := grpc.NewServer(icpt)
	testingv1.RegisterPolicyServiceServer(old, testingv1.UnimplementedPolicyServiceServer{})
	updated := grpc.NewServer(icpt)
	testingv1.RegisterPolicyServiceServer(updated, &policyServer{db: db})
	oldClient := testingv1.NewPolicyServiceClient(dial(t, serve(t, old)))
	newClient := testingv1.NewPolicyServiceClient(dial(t, serve(t, updated)))

	req := &testingv1.Request{Body: "rolling"}
	_, _, err := send(oldClient.Required, "rolling-key", req)
	require.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'rolling-key'`), "the key is released")

	resp, replayed, err := send(newClient.Required, "rolling-key", req)
	require.NoError(t, err)
	require.False(t, replayed)
	require.NotZero(t, resp.GetLedgerId())
	again, replayed, err := send(newClient.Required, "rolling-key", req)
	require.NoError(t, err)
	require.True(t, replayed)
	require.Equal(t, resp.GetLedgerId(), again.GetLedgerId())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'rolling'`))
	require.NotContains(t, idempotency.DefaultFinalCodes(), codes.Unimplemented)
}

// A validation failure does not use up the key: the corrected request can
// be sent with it (InvalidArgument is not final by default).
func TestValidationFailureReleasesTheKey(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if req.GetValue() == "" {
			return nil, status.Error(codes.InvalidArgument, "note is required")
		}
		return e.insertLedger(ctx, req)
	}})
	ctx := context.Background()
	r := e.call(ctx, methodCharge, "k", "")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Equal(t, 0, e.keyRows())
	r = e.call(ctx, methodCharge, "k", "fixed")
	require.NoError(t, r.err, "the corrected request, same key")
	require.False(t, r.replayed)
	require.True(t, e.call(ctx, methodCharge, "k", "fixed").replayed)
}

// A final error whose message is not valid UTF-8 is stored (repaired) and
// replayed, instead of failing to store and running again on every retry.
func TestFinalErrorWithInvalidUTF8IsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		return nil, status.Error(codes.FailedPrecondition, "account \xff\xfe frozen")
	}})
	ctx := context.Background()
	first := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.FailedPrecondition, status.Code(first.err), "%v", first.err)
	again := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.FailedPrecondition, status.Code(again.err))
	require.True(t, again.replayed)
	require.Equal(t, "account \uFFFD frozen", status.Convert(again.err).Message())
	require.Equal(t, status.Convert(first.err).Message(), status.Convert(again.err).Message(), "the first call and its replay agree")
	require.EqualValues(t, 1, e.runs.Load())
}
