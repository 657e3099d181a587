package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// forgetfulProvider is another system a step calls: it counts the calls it gets,
// and, like the payment providers it stands for, remembers the keys it saw
// until told to forget them.
type forgetfulProvider struct {
	mu      sync.Mutex
	calls   int
	charges map[string]string
}

func (p *forgetfulProvider) charge(key, what string) *wrapperspb.StringValue {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.charges == nil {
		p.charges = map[string]string{}
	}
	if _, ok := p.charges[key]; !ok {
		p.charges[key] = fmt.Sprintf("ch_%d %s", len(p.charges)+1, what)
	}
	return wrapperspb.String(p.charges[key])
}

func (p *forgetfulProvider) forget() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.charges = nil
}

// stepStore is a store on a pool of 4 (a step records on a connection of
// its own) with a ledger.
func stepStore(t *testing.T) (*testdb.DB, *idempotency.Store) {
	t.Helper()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	return db, store
}

var errAfterStep = errors.New("the handler failed after its step")

// A call whose handler fails after its step ran is run again: the step's
// recorded outcome comes back, and the provider, which has forgotten the
// key meanwhile, is not called again.
func TestStepRunsOnceAcrossRunsOfTheCall(t *testing.T) {
	t.Parallel()
	db, store := stepStore(t)
	p := &forgetfulProvider{}
	var runs atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		charge, err := idempotency.Step(ctx, "charge order-1", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			return p.charge(key, "order-1"), nil
		})
		if err != nil {
			return nil, err
		}
		if _, err := writeLedger(ctx, tx); err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			return nil, errAfterStep // not final: the key is released
		}
		return charge, nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, handler)
	require.ErrorIs(t, err, errAfterStep)
	p.forget()
	res, err := store.Execute(context.Background(), call, handler)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, "ch_1 order-1", res.Response.(*wrapperspb.StringValue).GetValue())
	require.Equal(t, 1, p.calls, "the provider was called once")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A step's final error is recorded, and returned to a re-run without
// calling out; a step's other errors are not recorded.
func TestStepRecordsAFinalErrorAndNothingElse(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	var calls atomic.Int64
	declined := status.Error(codes.FailedPrecondition, "card declined")
	var stepErr error
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, stepErr = idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			if calls.Add(1) == 1 {
				return nil, errors.New("connection reset by peer") // not final: not recorded
			}
			return nil, idempotency.Final(declined)
		})
		return nil, errAfterStep
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	for range 3 {
		_, err := store.Execute(context.Background(), call, handler)
		require.ErrorIs(t, err, errAfterStep)
	}
	require.EqualValues(t, 2, calls.Load(), "called until the step had a final outcome")
	require.True(t, idempotency.IsFinal(stepErr), "%v", stepErr)
	require.Equal(t, codes.FailedPrecondition, status.Code(stepErr))
	require.Equal(t, "card declined", status.Convert(stepErr).Message())
}

// A re-run that asks for a recorded step with another result type fails
// with ErrStepChanged, and sends nothing.
func TestStepOfAnotherTypeFailsLoudly(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	var calls atomic.Int64
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			calls.Add(1)
			return wrapperspb.String("ch_1"), nil
		}); err != nil {
			return nil, err
		}
		return nil, errAfterStep
	})
	require.ErrorIs(t, err, errAfterStep)
	var stepErr error
	_, err = store.Execute(context.Background(), call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, stepErr = idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.Int64Value, error) {
			calls.Add(1)
			return wrapperspb.Int64(1), nil
		})
		return nil, stepErr
	})
	require.ErrorIs(t, stepErr, idempotency.ErrStepChanged)
	require.Contains(t, stepErr.Error(), "google.protobuf.StringValue")
	require.Error(t, err)
	require.EqualValues(t, 1, calls.Load(), "nothing sent on the re-run")
}

// Steps of one call run in goroutines at once: each records its own
// outcome, and a re-run gets each back without calling out.
func TestConcurrentStepsOfOneCallRecordEachTheirOwn(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	p := &forgetfulProvider{}
	const steps = 16
	var runs atomic.Int64
	got := make([][steps]string, 2)
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		run := runs.Add(1) - 1
		var wg sync.WaitGroup
		errs := make([]error, steps)
		for i := range steps {
			wg.Go(func() {
				name := fmt.Sprintf("charge item-%d", i)
				v, err := idempotency.Step(ctx, name, func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
					return p.charge(key, name), nil
				})
				errs[i] = err
				got[run][i] = v.GetValue()
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return nil, err
		}
		if run == 0 {
			return nil, errAfterStep
		}
		return wrapperspb.String("done"), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, handler)
	require.ErrorIs(t, err, errAfterStep)
	p.forget()
	_, err = store.Execute(context.Background(), call, handler)
	require.NoError(t, err)
	require.Equal(t, steps, p.calls, "each step called out once")
	require.Equal(t, got[0], got[1], "each step's outcome came back to the re-run")
	for i := range steps {
		require.Contains(t, got[1][i], fmt.Sprintf("charge item-%d", i))
	}
}

// A step needs a running call: outside one it is refused, and nothing runs.
func TestStepOutsideACallIsRefused(t *testing.T) {
	t.Parallel()
	ran := false
	_, err := idempotency.Step(context.Background(), "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
		ran = true
		return nil, nil
	})
	require.ErrorIs(t, err, idempotency.ErrStepOutsideCall)
	require.False(t, ran)
}

// A step made inside a call and the same step made by a job outside it,
// under the key the call derived for it (an outbox's job), are one step:
// whichever ran first, the other gets its outcome without calling out.
func TestKeyedStepSharesTheRecordOfTheCallsStep(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	p := &forgetfulProvider{}
	var jobKey, jobScope string
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m", Scope: "tenant-1"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		jobKey, _ = idempotency.EffectKey(ctx, "charge")
		jobScope, _ = idempotency.IncomingScope(ctx) // what the call's job records
		if _, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			return p.charge(key, "inline"), nil
		}); err != nil {
			return nil, err
		}
		return nil, errAfterStep
	})
	require.ErrorIs(t, err, errAfterStep)
	p.forget()
	require.Equal(t, "tenant-1", jobScope)
	got, err := idempotency.KeyedStep(context.Background(), store, jobScope, jobKey, 0, func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
		return p.charge(key, "job"), nil
	})
	require.NoError(t, err)
	require.Equal(t, "ch_1 inline", got.GetValue())
	require.Equal(t, 1, p.calls)

	_, err = idempotency.KeyedStep(context.Background(), store, "", "not a key", 0, func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
		return p.charge(key, "job"), nil
	})
	require.ErrorIs(t, err, idempotency.ErrInvalidKey)
	require.Equal(t, 1, p.calls)
}

// Goroutines of one call that run the same step at once all get the
// outcome recorded first, whichever of them ran fn.
func TestOneStepRunAtOnceGivesEveryRunTheFirstRecord(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	var n atomic.Int64
	const runs = 8
	got := make([]string, runs)
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		var wg sync.WaitGroup
		for i := range runs {
			wg.Go(func() {
				v, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
					return wrapperspb.String(fmt.Sprint("answer ", n.Add(1))), nil
				})
				if err == nil {
					got[i] = v.GetValue()
				}
			})
		}
		wg.Wait()
		return wrapperspb.String("done"), nil
	})
	require.NoError(t, err)
	for i := range runs {
		require.Equal(t, got[0], got[i], "run %d", i)
	}
	require.NotEmpty(t, got[0])
	require.EqualValues(t, 1, n.Load(), "the work ran once: the others waited for its record")
}

// Inspect lists the steps a key's call ran, from every run, each with its
// name, outcome and key; and Inspect of a step's key shows that step.
func TestInspectShowsTheStepsOfAKey(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	var runs atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			return wrapperspb.String("ch_1"), nil
		}); err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			return nil, errAfterStep
		}
		_, err := idempotency.Step(ctx, "email receipt", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			return nil, idempotency.Final(status.Error(codes.InvalidArgument, "no address"))
		})
		if !idempotency.IsFinal(err) {
			return nil, fmt.Errorf("the receipt's step: %w", err)
		}
		return wrapperspb.String("paid"), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, handler)
	require.ErrorIs(t, err, errAfterStep)
	_, err = store.Execute(context.Background(), call, handler)
	require.NoError(t, err)
	rec, err := store.Inspect(context.Background(), "", "k")
	require.NoError(t, err)
	require.Len(t, rec.Steps, 2)
	charge, receipt := rec.Steps[0], rec.Steps[1]
	require.Equal(t, "charge", charge.Method)
	require.Equal(t, idempotency.TransportStep, charge.Transport)
	require.Equal(t, "succeeded", charge.State)
	require.Equal(t, "google.protobuf.StringValue", charge.ResponseType)
	require.Equal(t, "email receipt", receipt.Method)
	require.Equal(t, "failed", receipt.State)
	require.Equal(t, codes.InvalidArgument, receipt.Status.Code())
	step, err := store.Inspect(context.Background(), "", charge.Key)
	require.NoError(t, err)
	require.Equal(t, "charge", step.Method)
	require.Empty(t, step.Steps)
}

// A downstream gRPC call through the client chain with recorded effects is
// a step: a re-run of the running call gets the recorded reply (or the
// recorded final error) without sending the call again, though the
// downstream server has forgotten the key; without the option it is sent
// again.
func TestClientChainRecordsNamedEffectsAsSteps(t *testing.T) {
	t.Parallel()
	p := &forgetfulProvider{}
	var decline atomic.Bool
	srv := grpc.NewServer()
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if decline.Load() {
			p.charge("declined", req.GetValue())
			return nil, status.Error(codes.FailedPrecondition, "card declined")
		}
		md, _ := metadata.FromIncomingContext(ctx)
		return p.charge(md.Get(idempotency.MetadataKey)[0], req.GetValue()), nil
	}})
	addr := serve(t, srv)
	for _, record := range []bool{true, false} {
		t.Run(fmt.Sprint("recorded=", record), func(t *testing.T) {
			var opts []idempotency.ClientOption
			if record {
				opts = append(opts, idempotency.WithRecordedEffects())
			}
			conn := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(opts...))
			_, store := stepStore(t)
			p.forget()
			p.mu.Lock()
			p.calls = 0
			p.mu.Unlock()
			var runs atomic.Int64
			var got []string
			var errs []error
			handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				for _, name := range []string{"charge", "charge again"} {
					resp := &wrapperspb.StringValue{}
					err := conn.Invoke(idempotency.WithEffect(ctx, name), methodCharge, wrapperspb.String(name), resp)
					got, errs = append(got, resp.GetValue()), append(errs, err)
				}
				if runs.Add(1) == 1 {
					return nil, errAfterStep
				}
				return wrapperspb.String("done"), nil
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			decline.Store(false)
			_, err := store.Execute(context.Background(), call, handler)
			require.ErrorIs(t, err, errAfterStep)
			p.forget()
			_, err = store.Execute(context.Background(), call, handler)
			require.NoError(t, err)
			require.NoError(t, errors.Join(errs...))
			if record {
				require.Equal(t, 2, p.calls, "each effect sent once")
				require.Equal(t, got[:2], got[2:], "the re-run got the recorded replies")
			} else {
				require.Equal(t, 4, p.calls, "sent again: the server forgot the keys")
			}
		})
	}
	t.Run("a final error", func(t *testing.T) {
		conn := dialKeyed(t, addr, idempotency.UnaryClientInterceptor(idempotency.WithRecordedEffects(), idempotency.WithMaxAttempts(1)))
		_, store := stepStore(t)
		decline.Store(true)
		defer decline.Store(false)
		p.mu.Lock()
		p.calls = 0
		p.mu.Unlock()
		var callErr error
		for range 2 {
			_, err := store.Execute(context.Background(), idempotency.Call{Key: "d", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				callErr = conn.Invoke(idempotency.WithEffect(ctx, "charge"), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
				return nil, errAfterStep
			})
			require.ErrorIs(t, err, errAfterStep)
		}
		require.Equal(t, codes.FailedPrecondition, status.Code(callErr))
		require.Equal(t, "card declined", status.Convert(callErr).Message())
		require.Equal(t, 1, p.calls, "the decline was recorded, and not sent again")
	})
}

// HTTPClient and HTTPTransport with RecordEffects: a named request's
// response is recorded, and a re-run of the running call gets it (status,
// headers, body) without sending, though the server forgot the key; a
// response another attempt may change (503) is not recorded.
func TestHTTPClientsRecordNamedEffectsAsSteps(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	sent, charges := 0, map[string]string{}
	unavailable := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		sent++
		if unavailable > 0 {
			unavailable--
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		key := r.Header.Get(idempotency.HeaderKey)
		if _, ok := charges[key]; !ok {
			charges[key] = fmt.Sprintf(`{"id":"ch_%d"}`, len(charges)+1)
		}
		w.Header().Set("X-Charge", "yes")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, charges[key])
	}))
	t.Cleanup(srv.Close)
	clients := map[string]func(*http.Request) (*http.Response, error){
		"HTTPClient":    (&idempotency.HTTPClient{RecordEffects: true, MaxAttempts: 1}).Do,
		"HTTPTransport": (&http.Client{Transport: &idempotency.HTTPTransport{RecordEffects: true}}).Do,
	}
	for name, do := range clients {
		t.Run(name, func(t *testing.T) {
			_, store := stepStore(t)
			mu.Lock()
			sent, charges, unavailable = 0, map[string]string{}, 1
			mu.Unlock()
			var runs atomic.Int64
			var bodies []string
			handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				req, err := http.NewRequestWithContext(idempotency.WithEffect(ctx, "charge"), http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"cents":100}`))
				if err != nil {
					return nil, err
				}
				resp, err := do(req)
				if err != nil {
					return nil, err
				}
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				bodies = append(bodies, fmt.Sprint(resp.StatusCode, " ", resp.Header.Get("X-Charge"), " ", string(body)))
				if runs.Add(1) <= 2 {
					return nil, errAfterStep
				}
				return wrapperspb.String("done"), nil
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			for range 2 {
				_, err := store.Execute(context.Background(), call, handler)
				require.ErrorIs(t, err, errAfterStep)
				mu.Lock()
				charges = map[string]string{} // the server forgets every key
				mu.Unlock()
			}
			_, err := store.Execute(context.Background(), call, handler)
			require.NoError(t, err)
			require.Equal(t, []string{"503  ", `201 yes {"id":"ch_1"}`, `201 yes {"id":"ch_1"}`}, bodies)
			require.Equal(t, 2, sent, "sent again after the 503, not after the 201")
		})
	}
}

// A caller that leaves while the step's work runs (its context cancelled
// after the provider answered) does not lose the answer: it is recorded on
// a context of its own, and a re-run gets it without calling out.
func TestStepRecordsTheAnswerOfACallerThatLeft(t *testing.T) {
	t.Parallel()
	_, store := stepStore(t)
	p := &forgetfulProvider{}
	ctx, cancel := context.WithCancel(context.Background())
	var runs atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		charge, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			charge := p.charge(key, "order-1")
			cancel() // the caller leaves as the provider answers
			return charge, nil
		})
		if runs.Add(1) == 1 {
			return nil, errors.Join(errAfterStep, err) // the first run fails, whatever the step said
		}
		return charge, err
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(ctx, call, handler)
	require.ErrorIs(t, err, errAfterStep)
	p.forget()
	res, err := store.Execute(context.Background(), call, handler)
	require.NoError(t, err)
	require.Equal(t, "ch_1 order-1", res.Response.(*wrapperspb.StringValue).GetValue())
	require.Equal(t, 1, p.calls)
}

// A step needs a second connection: on a pool of one it is refused at
// once, and on a pool whose every connection is held by calls waiting for
// one it fails Unavailable within the finish timeout, nothing sent.
func TestStepWithoutASecondConnectionFailsBeforeSending(t *testing.T) {
	t.Parallel()
	var sent atomic.Int64
	step := func(ctx context.Context) error {
		_, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
			sent.Add(1)
			return wrapperspb.String("x"), nil
		})
		return err
	}
	t.Run("a pool of one", func(t *testing.T) {
		db, store := onePool(t)
		_ = db
		var stepErr error
		_, _ = store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			stepErr = step(ctx)
			return nil, stepErr
		})
		require.ErrorIs(t, stepErr, idempotency.ErrStepPool)
		require.Equal(t, codes.Internal, status.Code(stepErr))
	})
	t.Run("a saturated pool", func(t *testing.T) {
		db := testdb.New(t, 2)
		store := migratedStore(t, db, idempotency.WithFinishTimeout(300*time.Millisecond))
		var wg sync.WaitGroup
		var in sync.WaitGroup
		in.Add(2)
		errs := make([]error, 2)
		for i := range 2 {
			wg.Go(func() {
				_, _ = store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprint("k", i), Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					in.Done()
					in.Wait() // both calls hold their connection: none is left
					errs[i] = step(ctx)
					return nil, errs[i]
				})
			})
		}
		wg.Wait()
		for _, err := range errs {
			require.ErrorIs(t, err, idempotency.ErrStoreUnavailable)
			require.Equal(t, codes.Unavailable, status.Code(err))
		}
	})
	require.Zero(t, sent.Load(), "nothing was sent")
}

// Where sessions default to SERIALIZABLE or REPEATABLE READ, 16 runs of one
// step at once all get the one outcome, the work done once.
func TestStepUnderASerializableDefault(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"serializable", "repeatable read"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
				cfg.MaxConns = 20
				cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
			})
			store := migratedStore(t, db)
			var n atomic.Int64
			got := make([]string, 16)
			_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				var wg sync.WaitGroup
				errs := make([]error, len(got))
				for i := range got {
					wg.Go(func() {
						v, err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
							return wrapperspb.String(fmt.Sprint("answer ", n.Add(1))), nil
						})
						got[i], errs[i] = v.GetValue(), err
					})
				}
				wg.Wait()
				return wrapperspb.String("done"), errors.Join(errs...)
			})
			require.NoError(t, err)
			require.EqualValues(t, 1, n.Load())
			for i := range got {
				require.Equal(t, "answer 1", got[i])
			}
		})
	}
}

// Forget of a key deletes its steps' records: a redrive of a call whose
// step recorded a decline (Forget of a failure, once the card is fixed)
// runs the step again, as does a run after Forget of a charge refunded by
// hand.
func TestForgetDeletesTheStepsOfTheKey(t *testing.T) {
	t.Parallel()
	for _, state := range []string{"failed", ""} {
		t.Run(fmt.Sprintf("state %q", state), func(t *testing.T) {
			t.Parallel()
			_, store := stepStore(t)
			var calls atomic.Int64
			declined := state == "failed"
			handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
					calls.Add(1)
					if declined {
						return nil, idempotency.Final(status.Error(codes.FailedPrecondition, "card declined"))
					}
					return wrapperspb.String("ch_1"), nil
				})
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			_, _ = store.Execute(context.Background(), call, handler)
			declined = false // the card is fixed, or the charge refunded by hand
			require.NoError(t, store.Forget(context.Background(), "", "k", state))
			res, err := store.Execute(context.Background(), call, handler)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			require.EqualValues(t, 2, calls.Load(), "the step ran again")
			rec, err := store.Inspect(context.Background(), "", "k")
			require.NoError(t, err)
			require.Len(t, rec.Steps, 1)
		})
	}
}

// closeTracker is a request body that records its Close.
type closeTracker struct {
	io.Reader
	closed atomic.Bool
}

func (c *closeTracker) Close() error { c.closed.Store(true); return nil }

// A request answered from its step's record is not sent, and its body is
// closed all the same, as a RoundTripper must.
func TestARecordedRequestsBodyIsClosedWhenItIsNotSent(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	t.Cleanup(srv.Close)
	_, store := stepStore(t)
	client := &http.Client{Transport: &idempotency.HTTPTransport{RecordEffects: true}}
	var bodies []*closeTracker
	var runs atomic.Int64
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		body := &closeTracker{Reader: strings.NewReader("{}")}
		bodies = append(bodies, body)
		req, err := http.NewRequestWithContext(idempotency.WithEffect(ctx, "charge"), http.MethodPost, srv.URL, body)
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		_ = resp.Body.Close()
		if runs.Add(1) == 1 {
			return nil, errAfterStep
		}
		return wrapperspb.String("done"), nil
	}
	call := idempotency.Call{Key: "k", Method: "m"}
	_, err := store.Execute(context.Background(), call, handler)
	require.ErrorIs(t, err, errAfterStep)
	_, err = store.Execute(context.Background(), call, handler)
	require.NoError(t, err)
	require.Len(t, bodies, 2)
	require.True(t, bodies[1].closed.Load(), "the body of the request answered from the record is closed")
}
