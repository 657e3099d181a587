package idempotency_test

// Review 31: the canonical JSON fingerprint (httpjson.go). The rule: two
// requests a handler could tell apart are never one request (a replay of
// another request's response); two that differ only in whitespace, member
// order and string escapes are.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// review31Charge is what a typical Go handler decodes: encoding/json
// matches the key "amount" to the field whatever its case ("Amount",
// "AMOUNT"), and the last member it meets wins.
type review31Charge struct {
	Amount int64 `json:"amount"`
}

// review31Server serves a handler that decodes the body into review31Charge
// with encoding/json and answers with the amount it charged.
func review31Server(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		var c review31Charge
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d charged %d", n, c.Amount)
	})))
	t.Cleanup(srv.Close)
	return srv, &runs
}

// The canonical form sorts members by their key's exact bytes and keeps
// the order sent only among members of one exact key. encoding/json folds
// case when it matches a key to a struct field, so "amount" and "Amount"
// set the same field and the later one wins: {"amount":1,"Amount":500}
// charges 500, {"Amount":500,"amount":1} charges 1. Both canonicalise to
// {"Amount":500,"amount":1}: the second request is answered with the
// first's "charged 500" and its handler never runs.
func TestReview31JSONCaseFoldedDuplicateKeysInAnotherOrderAreDifferentRequests(t *testing.T) {
	t.Parallel()
	first, second := `{"amount":1,"Amount":500}`, `{"Amount":500,"amount":1}`
	// What the handler reads from each, decoded here to show they differ.
	var a, b review31Charge
	require.NoError(t, json.Unmarshal([]byte(first), &a))
	require.NoError(t, json.Unmarshal([]byte(second), &b))
	require.NotEqual(t, a.Amount, b.Amount, "the handler reads the two bodies differently")

	srv, runs := review31Server(t)
	r1 := sendJSON(t, srv, "k-fold", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	require.Equal(t, "run 1 charged 500", r1.body)
	r2 := sendJSON(t, srv, "k-fold", "application/json", second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader),
		"a request the handler reads as charging 1 was answered with the stored response of one charging 500: %q", r2.body)
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, r2.body)
	require.EqualValues(t, 1, runs.Load())
}

// The same with a folding beyond ASCII: encoding/json matches "ſ" (U+017F,
// long s) to a field named "s", as it matches "S".
func TestReview31JSONUnicodeFoldedDuplicateKeysInAnotherOrderAreDifferentRequests(t *testing.T) {
	t.Parallel()
	type s struct {
		S int64 `json:"s"`
	}
	first, second := `{"s":1,"ſ":500}`, `{"ſ":500,"s":1}`
	var a, b s
	require.NoError(t, json.Unmarshal([]byte(first), &a))
	require.NoError(t, json.Unmarshal([]byte(second), &b))
	require.NotEqual(t, a.S, b.S, "the handler reads the two bodies differently")

	srv, runs := jsonServer(t)
	r1 := sendJSON(t, srv, "k-fold-u", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	r2 := sendJSON(t, srv, "k-fold-u", "application/json", second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader), "replayed: %q", r2.body)
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, r2.body)
	require.EqualValues(t, 1, runs.Load())
}

// A JSON body sent with a charset parameter other than UTF-8: the canonical
// form reads the raw bytes as UTF-8 and decodes escapes to UTF-8, so the
// raw bytes C3 A9 and the escape "\u00e9" count as one string (é). A
// handler that honours the declared charset, ISO-8859-1, reads the raw
// bytes as "Ã©" and the escape as "é": two requests it tells apart were
// one, and the second got the first's response. A JSON body in another
// charset than UTF-8 is compared by its bytes: the second is 422.
func TestReview31JSONWithLatin1CharsetEscapesAreNotRawBytes(t *testing.T) {
	t.Parallel()
	const ct = "application/json; charset=iso-8859-1"
	first := `{"name":"caf` + "\xc3\xa9" + `"}` // raw bytes: in ISO-8859-1, "cafÃ©"
	second := `{"name":"caf\u00e9"}`            // an escape: "café" in any charset
	decode := func(body string) string {
		// ISO-8859-1: each byte is the code point of its value.
		var utf8Body []byte
		for _, c := range []byte(body) {
			utf8Body = utf8.AppendRune(utf8Body, rune(c))
		}
		var v struct{ Name string }
		require.NoError(t, json.Unmarshal(utf8Body, &v))
		return v.Name
	}
	require.Equal(t, "cafÃ©", decode(first))
	require.Equal(t, "café", decode(second))

	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d named %q", n, decode(string(b)))
	})))
	t.Cleanup(srv.Close)
	r1 := sendJSON(t, srv, "k-latin1", ct, first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)
	r2 := sendJSON(t, srv, "k-latin1", ct, second)
	require.NotEqual(t, "true", r2.header.Get(idempotency.ReplayedHeader), "replayed %q for a request naming %q", r2.body, decode(second))
	require.Equal(t, http.StatusUnprocessableEntity, r2.status, "the key with another request")
	require.EqualValues(t, 1, runs.Load())
}

// What a handler tells apart and the canonical form must keep apart:
// Unicode normalisation forms, numbers written otherwise, a lone
// surrogate against U+FFFD, invalid UTF-8 against U+FFFD, a BOM, trailing
// garbage, a key of the object structure spelled as a string.
func TestReview31JSONValuesAHandlerTellsApartAre422(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	cases := []struct{ first, other string }{
		{`{"n":"caf` + "\u00e9" + `"}`, `{"n":"cafe` + "\u0301" + `"}`}, // NFC vs NFD
		{`{"n":"caf\u00e9"}`, `{"n":"cafe\u0301"}`},
		{`{"n":0}`, `{"n":-0}`},
		{`{"n":1}`, `{"n":1e0}`},
		{`{"n":1E400}`, `{"n":1e400}`},
		{`{"n":"\ufffd"}`, `{"n":"\ud800"}`},
		{`{"n":"\ufffd"}`, `{"n":"` + "\xff" + `"}`},
		{`{"n":"\u0000"}`, `{"n":""}`},
		{`{"n":"a"}`, "\xef\xbb\xbf" + `{"n":"a"}`},
		{`{"n":"a"}`, `{"n":"a"}x`},
		{`{"n":"a"}`, `{"n":"a"}{}`},
		{`[{"a":"b"}]`, `[{"a":"b"},{}]`},
		{`{"a":[1,2]}`, `{"a":[12]}`},
		{`{"a":{"b":"c,d"}}`, `{"a":{"b":"c","d":null}}`},
		{`{"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":1}`, `{"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":[1]}`},
		{`{"k":{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}}`, `{"k":[{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}]}`},
		{`{"a":1,"a":2,"b":3}`, `{"a":2,"b":3,"a":1}`},
		{`{"a":"\"b\":1"}`, `{"a":"","b":1}`},
	}
	for i, c := range cases {
		key := fmt.Sprintf("k-apart-%d", i)
		r1 := sendJSON(t, srv, key, "application/json", c.first)
		require.Equal(t, http.StatusCreated, r1.status, r1.body)
		r := sendJSON(t, srv, key, "application/json", c.other)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%q after %q: %s", c.other, c.first, r.body)
	}
	require.EqualValues(t, len(cases), runs.Load())
}

// Bodies that differ only as the rule allows replay, deep nesting and
// structured-suffix types with parameters included.
func TestReview31JSONWrittenAnotherWayReplays(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	deep := func(n int, sep string) string {
		return string(bytes.Repeat([]byte("["+sep), n)) + "1" + string(bytes.Repeat([]byte(sep+"]"), n))
	}
	cases := []struct{ ct, first, other string }{
		{"application/problem+json", `{"type":"about:blank","title":"x"}`, `{ "title" : "x" , "type" : "about:blank" }`},
		{"application/json; charset=utf-8", `{"a":"\/"}`, `{"a":"/"}`},
		{"application/json", deep(9000, ""), deep(9000, " ")},
		{"application/json", `{"a":"\u00E9\uD83D\uDE00"}`, `{"a":"é😀"}`},
		{"application/json", `{"z":{"y":[1,{"q":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr","p":2}]},"a":1}`, `{"a":1,"z":{"y":[1,{"p":2,"q":"rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"}]}}`},
	}
	for i, c := range cases {
		key := fmt.Sprintf("k-same-%d", i)
		r1 := sendJSON(t, srv, key, c.ct, c.first)
		require.Equal(t, http.StatusCreated, r1.status, r1.body)
		r := sendJSON(t, srv, key, c.ct, c.other)
		require.Equal(t, http.StatusCreated, r.status, "%d: %s", i, r.body)
		require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), "%d", i)
	}
	require.EqualValues(t, len(cases), runs.Load())
}
