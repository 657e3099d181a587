package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// review31PanickyTracer panics in the methods it is told to, with values
// of several kinds (an error, nil, a value whose String panics).
type review31PanickyTracer struct {
	start, end bool
	value      func() any
}

func (p review31PanickyTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	if p.start {
		panic(p.value())
	}
	return context.WithValue(ctx, review31Key{}, "traced")
}

func (p review31PanickyTracer) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {
	if p.end {
		panic(p.value())
	}
}

type review31Key struct{}

type review31BadStringer struct{}

func (review31BadStringer) String() string { panic("String panicked too") }

// A tracer that panics (at the start, at the end, or both; with an error,
// nil, or a value whose String panics) changes nothing a caller sees:
// Execute's outcomes and errors, the HTTP status and body, and the rows.
func TestReview31PanickingTracerChangesNoOutcome(t *testing.T) {
	t.Parallel()
	values := map[string]func() any{
		"error":         func() any { return errors.New("tracer bug") },
		"nil":           func() any { return nil },
		"string panics": func() any { return review31BadStringer{} },
		"abort handler": func() any { return http.ErrAbortHandler },
	}
	for name, value := range values {
		for _, where := range []review31PanickyTracer{{start: true}, {end: true}, {start: true, end: true}} {
			where.value = value
			label := fmt.Sprintf("%s start=%v end=%v", name, where.start, where.end)
			db := suiteDB(t)
			store := migratedStore(t, db, idempotency.WithTracer(where))
			ctx := context.Background()
			var ran atomic.Int64
			run := func(key string, fail error) (idempotency.Result, error) {
				return store.Execute(ctx, idempotency.Call{Scope: "s", Key: key, Method: "/r31.Svc/Do"},
					func(context.Context, pgx.Tx) (proto.Message, error) {
						ran.Add(1)
						if fail != nil {
							return nil, fail
						}
						return wrapperspb.String("ok-" + key), nil
					})
			}
			res, err := run("a", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, label)
			res, err = run("a", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, label)
			_, err = run("b", idempotency.Final(status.Error(codes.NotFound, "no such order")))
			require.Equal(t, codes.NotFound, status.Code(err), label)
			_, err = run("b", nil)
			require.Equal(t, codes.NotFound, status.Code(err), label)
			_, err = run("c", status.Error(codes.Unavailable, "downstream"))
			require.Equal(t, codes.Unavailable, status.Code(err), label)
			res, err = run("c", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, label)
			require.EqualValues(t, 4, ran.Load(), label)

			srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "created")
			})))
			for i := range 2 {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/x", strings.NewReader("{}"))
				require.NoError(t, err)
				req.Header.Set(idempotency.HeaderKey, "h")
				resp, err := srv.Client().Do(req)
				require.NoError(t, err, label)
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.Equal(t, http.StatusCreated, resp.StatusCode, label)
				require.Equal(t, "created", string(b), label)
				require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true", label)
			}
			srv.Close()
			require.Equal(t, 4, db.Count(t, `SELECT count(*) FROM idempotency_keys`), label)
		}
	}
}
