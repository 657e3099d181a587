package idempotencyconnect_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Every caller of a key gets the same answer: a connect handler's final
// error, whatever its shape, reaches the first caller exactly as it
// reaches every replay (code, message, details byte for byte, and the
// error's metadata), in every protocol.
func TestFinalErrorAnswersEveryCallerAlike(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	var fnErr atomic.Pointer[error]
	url := r32Mount(t, e.store, func(context.Context, *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		return nil, *fnErr.Load()
	}, nil, nil, nil)
	ctx := context.Background()
	for i, shape := range connectFinalShapes() {
		t.Run(shape.name, func(t *testing.T) {
			for _, p := range protocols {
				key := fmt.Sprintf("final-%d-%s", i, p.name)
				c := client(t, url, procRequired, p, true)
				before := runs.Load()
				err := shape.err()
				fnErr.Store(&err)
				_, err = c.CallUnary(ctx, keyed(key, "x"))
				first := connectAnswer(t, err)
				require.Equal(t, shape.code, first.code, "%s: %v", p.name, err)
				again := errors.New("the handler ran again")
				fnErr.Store(&again)
				_, err = c.CallUnary(ctx, keyed(key, "x"))
				require.Equal(t, first, connectAnswer(t, err), "%s: the replay is the first answer", p.name)
				require.Equal(t, before+1, runs.Load(), "%s: the handler ran once", p.name)
			}
		})
	}
}

// connectFinalShape is an error a connect handler returns: marked Final,
// or with a code the server stores by default.
type connectFinalShape struct {
	name string
	err  func() error // a new one for each call: connect adds to an error's metadata
	code connect.Code
}

func connectFinalShapes() []connectFinalShape {
	declined := func() *connect.Error {
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("the card was declined"))
		d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example", Metadata: map[string]string{"card": "4242"}})
		if err != nil {
			panic(err)
		}
		ce.AddDetail(d)
		ce.Meta().Set("X-Decline-Code", "51")
		return ce
	}
	return []connectFinalShape{
		{name: "a plain error", err: func() error { return idempotency.Final(errors.New("card declined")) }, code: connect.CodeUnknown},
		{name: "a plain error wrapped with %w", err: func() error { return idempotency.Final(fmt.Errorf("charge 42: %w", errors.New("card declined"))) }, code: connect.CodeUnknown},
		{name: "a connect error", err: func() error { return connect.NewError(connect.CodeNotFound, errors.New("no such card")) }, code: connect.CodeNotFound},
		{name: "a connect error with details and metadata", err: func() error { return declined() }, code: connect.CodeFailedPrecondition},
		{name: "a connect error with details and metadata, marked Final", err: func() error { return idempotency.Final(declined()) }, code: connect.CodeFailedPrecondition},
		{name: "a connect error with details and metadata, wrapped with %w", err: func() error { return fmt.Errorf("charge 42: %w", declined()) }, code: connect.CodeFailedPrecondition},
		{name: "a gRPC status error", err: func() error { return status.Error(codes.NotFound, "no such card") }, code: connect.CodeNotFound},
		{name: "a gRPC status error wrapped with %w, marked Final", err: func() error {
			return idempotency.Final(fmt.Errorf("charge 42: %w", status.Error(codes.NotFound, "no such card")))
		}, code: connect.CodeNotFound},
		{name: "a connect error whose message is not UTF-8", err: func() error { return connect.NewError(connect.CodeNotFound, errors.New("caf\xe9 card")) }, code: connect.CodeNotFound},
		{name: "a context's error", err: func() error { return idempotency.Final(context.DeadlineExceeded) }, code: connect.CodeDeadlineExceeded},
		{name: "a context's error wrapped with %w", err: func() error { return idempotency.Final(fmt.Errorf("the bank timed out: %w", context.Canceled)) }, code: connect.CodeCanceled},
		{name: "an error whose status is nil", err: func() error { return idempotency.Final(statusError{text: "no status"}) }, code: connect.CodeUnknown},
		{name: "an error whose status says OK", err: func() error {
			return idempotency.Final(statusError{st: status.New(codes.OK, "all good"), text: "all good"})
		}, code: connect.CodeUnknown},
	}
}

// statusError is an error with a gRPC status of its own, which may be nil.
type statusError struct {
	st   *status.Status
	text string
}

func (e statusError) Error() string              { return e.text }
func (e statusError) GRPCStatus() *status.Status { return e.st }

// connectErrAnswer is what a connect client sees of an error: its code,
// message, details (type and bytes) and metadata, less what a transport
// sets for itself and the replay marker.
type connectErrAnswer struct {
	code    connect.Code
	msg     string
	details []string
	meta    string
}

func connectAnswer(t *testing.T, err error) connectErrAnswer {
	t.Helper()
	var ce *connect.Error
	require.True(t, errors.As(err, &ce), "%v is a connect error", err)
	a := connectErrAnswer{code: ce.Code(), msg: ce.Message()}
	for _, d := range ce.Details() {
		a.details = append(a.details, d.Type()+":"+string(d.Bytes()))
	}
	var meta []string
	for k, vs := range ce.Meta() {
		if k = strings.ToLower(k); strings.HasPrefix(k, "x-") {
			meta = append(meta, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(meta)
	a.meta = strings.Join(meta, ";")
	return a
}
