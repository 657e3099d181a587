package idempotency

import (
	"net/http"
	"reflect"
	"strings"
)

// WithHTTPRoute sets the function that names the route a request will
// take: the template it matches, such as "/v1/orders/{id}/refunds", never
// the path it was sent to. The route is what a [Tracer] sees as the call's
// method (TraceCallStartData.Method), so what metrics are labelled with and
// spans named after; a template keeps them bounded, where a path gives a
// time series per order. A request whose route is "" is one the router
// will not route (its answer is 404 or 405): it passes through untouched,
// with no key claimed, stored or traced.
//
// Give it for a router the middleware cannot ask. By default the route is
// the pattern of the handler the middleware wraps, when that handler is
// net/http's *http.ServeMux (its Handler method says which pattern a
// request will match: HTTPMiddleware(store)(mux); a type that embeds one
// is not asked, as it may serve what the mux does not); else r.Pattern, which
// net/http's mux has set when the middleware is mounted per route; else
// unknown, and traced as the request method alone. chi's r.Use(mw) runs
// before chi routes, so give chi's own lookup:
//
//	idempotency.WithHTTPRoute(func(r *http.Request) string {
//		return router.Find(chi.NewRouteContext(), r.Method, r.URL.Path)
//	})
//
// Use with care: a function that returns the raw path makes a time series
// and a span name per path again, and one that returns "" for a route that
// exists leaves that route unprotected. Defaults to nil (the pattern, as
// above).
func WithHTTPRoute(f func(r *http.Request) string) HTTPOption {
	return func(o *httpOptions) { o.routeOf = f }
}

// redirectHandlerType is the type of the handler a ServeMux gives for a
// request it answers with a redirect to the canonical path.
var redirectHandlerType = reflect.TypeOf(http.RedirectHandler("/", http.StatusTemporaryRedirect))

// route returns the route of a request as the call's traced method (the
// request method and the route's template, "POST /v1/orders/{id}", or the
// request method alone when the route is not known), and false when the
// router behind will not route the request: no pattern matches it (404,
// 405), or a ServeMux redirects it to its canonical path (a redirect
// stored under the key would make the redirected request, sent with the
// same key to another path, a 422).
func (o *httpOptions) route(next http.Handler, r *http.Request) (string, bool) {
	var pattern string
	// Only net/http's own ServeMux: a router that embeds one, or has a
	// Handler method of its own, may serve what the mux has no pattern for
	// (a fallback, a catch-all), which must stay protected.
	switch mux, isMux := next.(*http.ServeMux); {
	case o.routeOf != nil:
		pattern = o.routeOf(r)
		if pattern == "" {
			return "", false
		}
	case isMux:
		var h http.Handler
		h, pattern = mux.Handler(r)
		if pattern == "" || reflect.TypeOf(h) == redirectHandlerType {
			return "", false
		}
	default:
		pattern = r.Pattern
	}
	if pattern == "" {
		return r.Method, true
	}
	// A ServeMux pattern is "[METHOD ][HOST]/[PATH]": the request's method
	// replaces the pattern's (a GET pattern serves HEAD).
	if i := strings.IndexAny(pattern, " \t"); i >= 0 {
		pattern = strings.TrimLeft(pattern[i+1:], " \t")
	}
	return r.Method + " " + pattern, true
}
